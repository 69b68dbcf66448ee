"""Live plots: one widget draws a set of plotly figures and takes incremental updates.

For a new set of figures only the difference is sent (:func:`figure_ops`); the browser applies
it to its copy and redraws with ``Plotly.react``. :meth:`LivePlots.sync` resends the whole state
as the ``figures`` trait (what a reloaded page restores). Each update carries an increasing
``seq`` that views answer with ``{"drawn": seq}`` once drawn, so a sender can wait for the
browser (:meth:`LivePlots.awaiting_draw`); the wait is bounded, since a busy kernel or an
undisplayed widget gets no answer. plotly.js is loaded once per kernel by :class:`PlotlyLib`.
"""

from __future__ import annotations

import json
import threading
import time
from functools import cache
from pathlib import Path
from typing import Any

import anywidget
import traitlets
from ipywidgets import widget_serialization

__all__ = ["LivePlots", "PlotlyLib", "figure_ops", "spec_of"]


def spec_of(fig: Any) -> dict[str, Any]:
    """A plotly figure as plain JSON (``data``, ``layout``), as the browser will hold it."""
    spec = json.loads(fig.to_json())
    spec["layout"].pop("template", None)  # the default template: plotly.js has its own
    spec["layout"]["autosize"] = True  # the width comes from the notebook, not a fixed size
    spec["layout"].pop("width", None)
    return {"data": spec.get("data", []), "layout": spec["layout"]}


def _tail(old: dict[str, Any], new: dict[str, Any]) -> dict[str, list[Any]] | None:
    """The points ``new`` appends to trace ``old`` (key -> tail), or None if it changed otherwise."""
    if old.keys() != new.keys():
        return None
    out: dict[str, list[Any]] = {}
    for k, v in new.items():
        ov = old[k]
        if ov == v:
            continue
        if isinstance(ov, list) and isinstance(v, list) and len(v) > len(ov) and v[: len(ov)] == ov:
            out[k] = v[len(ov) :]
        else:
            return None
    return out


def figure_ops(name: str, old: dict[str, Any] | None, new: dict[str, Any]) -> list[dict[str, Any]]:
    """Operations that turn figure spec ``old`` into ``new`` (both from :func:`spec_of`).

    * ``{"op": "extend", "fig", "index", "points": {key: tail}}``: points appended to a trace
      (every array of the trace that grew, with its new elements only);
    * ``{"op": "trace", "fig", "index", "trace"}``: one trace replaced (or added at the end);
    * ``{"op": "layout", "fig", "layout": {key: value}}``: the top-level layout keys that changed
      (a removed key has value None);
    * ``{"op": "figure", "fig", "figure"}``: the whole figure (new, or traces removed).
    """
    if old is None or len(new["data"]) < len(old["data"]):
        return [{"op": "figure", "fig": name, "figure": new}]
    ops: list[dict[str, Any]] = []
    for i, trace in enumerate(new["data"]):
        prev = old["data"][i] if i < len(old["data"]) else None
        if prev == trace:
            continue
        tail = _tail(prev, trace) if prev is not None else None
        if tail:
            ops.append({"op": "extend", "fig": name, "index": i, "points": tail})
        else:
            ops.append({"op": "trace", "fig": name, "index": i, "trace": trace})
    lo, ln = old["layout"], new["layout"]
    changed = {k: ln.get(k) for k in lo.keys() | ln.keys() if lo.get(k) != ln.get(k)}
    if changed:
        ops.append({"op": "layout", "fig": name, "layout": changed})
    return ops


def apply_ops(figs: dict[str, dict[str, Any]], ops: list[dict[str, Any]]) -> None:
    """Apply ``ops`` to specs in place: what the browser does (the tests check both agree)."""
    for op in ops:
        name = op["fig"]
        if op["op"] == "figure":
            figs[name] = json.loads(json.dumps(op["figure"]))
            continue
        fig = figs[name]
        if op["op"] == "extend":
            for k, tail in op["points"].items():
                fig["data"][op["index"]][k].extend(tail)
        elif op["op"] == "trace":
            if op["index"] < len(fig["data"]):
                fig["data"][op["index"]] = op["trace"]
            else:
                fig["data"].append(op["trace"])
        elif op["op"] == "layout":
            for k, v in op["layout"].items():
                if v is None:
                    fig["layout"].pop(k, None)
                else:
                    fig["layout"][k] = v


@cache
def _plotly_js() -> str:
    import plotly

    return (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_text(encoding="utf-8")


class PlotlyLib(anywidget.AnyWidget):  # type: ignore[misc]
    """Loads plotly.js into the page (``window.Plotly``) when its model is created; never displayed.

    One per kernel (:meth:`shared`), so the library crosses the wire once, not per dashboard.
    """

    _lock = threading.Lock()
    _instance: PlotlyLib | None = None

    def __init__(self) -> None:
        esm = (
            "export default { initialize() {\n"
            "  if (globalThis.Plotly) return;\n"
            "  (function () {\n" + _plotly_js() + "\n  }).call(globalThis);\n"
            "} };\n"
        )
        super().__init__(_esm=esm)

    @classmethod
    def shared(cls) -> PlotlyLib:
        with cls._lock:
            if cls._instance is None or cls._instance.comm is None:
                cls._instance = cls()
            return cls._instance


_ESM = r"""
const STATES = new Map();  // model uid -> {figs, views, seq: the highest update message applied}
const clone = (x) => JSON.parse(JSON.stringify(x));

async function plotly() {
  for (let i = 0; i < 600 && !globalThis.Plotly; i++) await new Promise((r) => setTimeout(r, 100));
  return globalThis.Plotly;
}

function stateOf(model) {
  const uid = model.get("uid");
  if (!STATES.has(uid)) STATES.set(uid, { figs: clone(model.get("figures") || {}), views: new Set(), seq: 0 });
  return STATES.get(uid);
}

function apply(figs, op) {
  if (op.op === "figure") { figs[op.fig] = op.figure; return; }
  const fig = figs[op.fig];
  if (!fig) return;
  if (op.op === "extend") {
    const t = fig.data[op.index];
    for (const [k, tail] of Object.entries(op.points)) t[k] = (t[k] || []).concat(tail);
  } else if (op.op === "trace") {
    fig.data[op.index] = op.trace;
  } else if (op.op === "layout") {
    for (const [k, v] of Object.entries(op.layout)) { if (v === null) delete fig.layout[k]; else fig.layout[k] = v; }
  }
}

function initialize({ model }) {
  const st = stateOf(model);
  model.on("change:figures", () => {
    st.figs = clone(model.get("figures") || {});
    st.views.forEach((v) => v.draw(Object.keys(st.figs)));
  });
  model.on("msg:custom", (msg) => {
    if (!msg || !Array.isArray(msg.ops)) return;
    for (const op of msg.ops) apply(st.figs, op);
    if (typeof msg.seq === "number") st.seq = Math.max(st.seq, msg.seq);
    const names = [...new Set(msg.ops.map((op) => op.fig))];
    st.views.forEach((v) => v.draw(names));
  });
}

async function render({ model, el }) {
  const st = stateOf(model);
  const Plotly = await plotly();
  el.classList.add("rollart-live-plots");
  const grid = document.createElement("div");
  grid.style.cssText = "display:grid;grid-template-columns:repeat(auto-fit,minmax(380px,1fr));gap:6px;width:100%;";
  el.appendChild(grid);
  const cells = new Map();
  const pending = new Set();
  let frame = null;
  let acked = 0;  // the highest seq this view has told the kernel it drew
  let closed = false;  // the view was removed: draw and answer nothing more
  const view = {
    draw(names) {
      names.forEach((n) => pending.add(n));
      if (frame === null) frame = requestAnimationFrame(flush);
    },
  };
  function cell(name) {
    if (!cells.has(name)) {
      const div = document.createElement("div");
      div.className = "rollart-plot";
      div.dataset.name = name;
      div.style.minWidth = "0";
      if ((model.get("wide") || []).includes(name)) div.style.gridColumn = "1 / -1";
      const order = model.get("order") || [];
      div.style.order = String(order.indexOf(name) >= 0 ? order.indexOf(name) : order.length);
      grid.appendChild(div);
      cells.set(name, div);
    }
    return cells.get(name);
  }
  function flush() {
    frame = null;
    if (!Plotly || closed) return;
    const seq = st.seq;
    const drawing = [];
    try {
      for (const name of pending) {
        const fig = st.figs[name];
        if (!fig) continue;
        const layout = Object.assign(clone(fig.layout), { autosize: true });
        delete layout.width;
        drawing.push(Plotly.react(cell(name), clone(fig.data), layout, { responsive: true, displaylogo: false }));
      }
    } catch (e) {
      console.warn("rollart dashboard: a plot failed to draw", e);
    } finally {
      pending.clear();
    }
    // tell the kernel what is on screen, so it sends the next update only then (see LivePlots)
    const ack = () => {
      if (closed || seq <= acked) return;
      acked = seq;
      try { model.send({ drawn: seq }); } catch (e) { /* the widget was closed meanwhile */ }
    };
    Promise.all(drawing).then(ack, ack);  // a failed draw must not hold updates back either
  }
  const ro = new ResizeObserver(() => cells.forEach((div) => { if (div.data) Plotly.Plots.resize(div); }));
  ro.observe(grid);
  st.views.add(view);
  view.draw(Object.keys(st.figs));
  return () => {
    closed = true;
    if (frame !== null) cancelAnimationFrame(frame);
    st.views.delete(view);
    ro.disconnect();
    cells.forEach((div) => Plotly && Plotly.purge(div));
  };
}

export default { initialize, render };
"""


class LivePlots(anywidget.AnyWidget):  # type: ignore[misc]
    """A responsive grid of plotly figures that takes incremental updates (:meth:`update`).

    Args:
        order: figure names in display order.
        wide: names of figures that span the full width.
        ack_timeout_s: :meth:`awaiting_draw` gives up waiting for a view's answer after this long.

    Attributes:
        sent: what the browser holds now (name -> spec), kept in step with every message.
        messages: ``(number of ops, bytes)`` of each update message sent, for inspection.
        sent_seq: ``seq`` of the last update message sent (0: none yet).
        drawn_seq: the highest ``seq`` a view has drawn (0: no answer yet).
        drawn_at: ``time.monotonic()`` of the last answer that raised ``drawn_seq`` (None: none).

    Example:
        >>> plots = LivePlots(order=["f"])                           # doctest: +SKIP
        >>> plots.update({"f": spec_of(fig)})                        # doctest: +SKIP
        >>> plots.awaiting_draw()                                    # doctest: +SKIP
        False
    """

    _esm = _ESM
    uid = traitlets.Unicode().tag(sync=True)
    figures = traitlets.Dict().tag(sync=True)
    order = traitlets.List(traitlets.Unicode()).tag(sync=True)
    wide = traitlets.List(traitlets.Unicode()).tag(sync=True)
    lib = traitlets.Instance(PlotlyLib, allow_none=True).tag(sync=True, **widget_serialization)

    def __init__(
        self,
        order: list[str],
        wide: list[str] = (),  # type: ignore[assignment]
        *,
        ack_timeout_s: float = 1.0,
    ) -> None:
        import uuid

        super().__init__(uid=uuid.uuid4().hex, order=list(order), wide=list(wide), lib=PlotlyLib.shared())
        self.sent: dict[str, dict[str, Any]] = {}
        self.messages: list[tuple[int, int]] = []
        self.ack_timeout_s = float(ack_timeout_s)
        self.sent_seq, self.drawn_seq = 0, 0
        self.drawn_at: float | None = None
        self._sent_at = 0.0
        self.on_msg(self._on_view_msg)

    def _on_view_msg(self, _widget: Any, content: Any, _buffers: Any) -> None:
        """A view's ``{"drawn": seq}``: keep the highest (several views may answer)."""
        drawn = content.get("drawn") if isinstance(content, dict) else None
        if isinstance(drawn, int) and not isinstance(drawn, bool) and drawn > self.drawn_seq:
            self.drawn_seq = drawn
            self.drawn_at = time.monotonic()

    def awaiting_draw(self, timeout_s: float | None = None) -> bool:
        """True while the last update message is not drawn yet and was sent less than
        ``timeout_s`` (default ``ack_timeout_s``) ago; False once a view answered or time ran out."""
        timeout = self.ack_timeout_s if timeout_s is None else float(timeout_s)
        return self.drawn_seq < self.sent_seq and time.monotonic() - self._sent_at < timeout

    def update(self, specs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
        """Send what changed between the figures shown and ``specs`` (name -> :func:`spec_of`); returns the ops."""
        ops = [op for name, spec in specs.items() for op in figure_ops(name, self.sent.get(name), spec)]
        if not ops:
            return ops
        if not self.figures:  # the first draw: the state itself, so a view opened at any time has it
            self.sent = json.loads(json.dumps(specs))
            self.figures = json.loads(json.dumps(specs))  # a copy: ``sent`` moves on with every message
            self.messages.append((0, len(json.dumps(specs))))
            return ops
        msg = {"ops": ops, "seq": self.sent_seq + 1}
        self._sent_at = time.monotonic()
        self.send(msg)
        self.sent_seq += 1
        apply_ops(self.sent, json.loads(json.dumps(ops)))
        self.messages.append((len(ops), len(json.dumps(msg))))
        return ops

    def sync(self) -> None:
        """Resend the whole state as the ``figures`` trait (what a reloaded page restores)."""
        if self.sent and self.sent != self.figures:
            self.figures = json.loads(json.dumps(self.sent))
