import subprocess
import sys

import rollart_nb as rn


def test_all_is_sorted_and_complete():
    names = rn.__all__
    assert names == sorted(names)
    public = {n for n in dir(rn) if not n.startswith("_")}
    # every public attribute that is not a submodule is exported
    import types

    missing = {n for n in public if not isinstance(getattr(rn, n), types.ModuleType) and n not in names}
    assert not missing, f"public names not in __all__: {missing}"
    for n in names:
        assert hasattr(rn, n), n


def test_import_starts_nothing():
    code = "import sys, rollart_nb; print('ray' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
