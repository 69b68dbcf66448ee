"""A seccomp filter for the code sandbox, as the classic-BPF program bubblewrap's ``--seccomp`` reads.

Namespaces leave some kernel interfaces shared with the host. The filter closes those a
sandboxed program has no use for (the syscall numbers come from the kernel's own tables:
``asm/unistd_64.h`` and ``asm-generic/unistd.h``):

* the kernel keyrings (``keyctl``, ``add_key``, ``request_key``): a new session does not get a
  new session keyring, so the caller's keys would be readable and writable;
* sockets other than ``AF_UNIX``, ``AF_INET`` and ``AF_INET6`` (``AF_VSOCK`` is not isolated by
  a network namespace; ``AF_PACKET``, ``AF_ALG``, netlink and friends are kernel attack surface);
* ``memfd_create`` and System V ``shmget``/``shmat`` (memory outside the address-space
  limit), ``io_uring_*`` (bypasses seccomp for the operations it queues), ``userfaultfd``,
  ``bpf``, ``perf_event_open``, ``ptrace``, ``process_vm_*``, ``kcmp``, mounts (old and new API), ``unshare``/``setns``, modules, kexec,
  swap, reboot, ``syslog``, ``acct``, ``quotactl``, file handles, ``fanotify_init``,
  ``personality``;
* every syscall of another ABI (32-bit or x32 entry points kill the process or fail).

Denied calls fail with ``EPERM`` (sockets of other families with ``EAFNOSUPPORT``), so Python
raises a normal ``OSError``. Supported machines: x86_64 and aarch64; elsewhere
:func:`program` returns ``None`` and the sandbox runs without the filter (logged).
"""

from __future__ import annotations

import errno
import logging
import os
import platform
import struct

__all__ = ["DENIED", "program", "program_fd"]

log = logging.getLogger(__name__)

DENIED = (
    "keyctl",
    "add_key",
    "request_key",
    "memfd_create",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "unshare",
    "setns",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "open_by_handle_at",
    "name_to_handle_at",
    "swapon",
    "swapoff",
    "reboot",
    "syslog",
    "acct",
    "quotactl",
    "fanotify_init",
    "lookup_dcookie",
    "personality",
    "shmget",
    "shmat",
)

_X86_64 = {
    "keyctl": 250,
    "add_key": 248,
    "request_key": 249,
    "memfd_create": 319,
    "ptrace": 101,
    "mount": 165,
    "umount2": 166,
    "pivot_root": 155,
    "chroot": 161,
    "unshare": 272,
    "setns": 308,
    "bpf": 321,
    "perf_event_open": 298,
    "userfaultfd": 323,
    "kexec_load": 246,
    "kexec_file_load": 320,
    "init_module": 175,
    "finit_module": 313,
    "delete_module": 176,
    "open_by_handle_at": 304,
    "name_to_handle_at": 303,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "swapon": 167,
    "swapoff": 168,
    "reboot": 169,
    "syslog": 103,
    "acct": 163,
    "quotactl": 179,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "kcmp": 312,
    "fanotify_init": 300,
    "lookup_dcookie": 212,
    "personality": 135,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "mount_setattr": 442,
    "socket": 41,
    "shmget": 29,
    "shmat": 30,
}
_AARCH64 = {
    "keyctl": 219,
    "add_key": 217,
    "request_key": 218,
    "memfd_create": 279,
    "ptrace": 117,
    "mount": 40,
    "umount2": 39,
    "pivot_root": 41,
    "chroot": 51,
    "unshare": 97,
    "setns": 268,
    "bpf": 280,
    "perf_event_open": 241,
    "userfaultfd": 282,
    "kexec_load": 104,
    "kexec_file_load": 294,
    "init_module": 105,
    "finit_module": 273,
    "delete_module": 106,
    "open_by_handle_at": 265,
    "name_to_handle_at": 264,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "swapon": 224,
    "swapoff": 225,
    "reboot": 142,
    "syslog": 116,
    "acct": 89,
    "quotactl": 60,
    "process_vm_readv": 270,
    "process_vm_writev": 271,
    "kcmp": 272,
    "fanotify_init": 262,
    "lookup_dcookie": 18,
    "personality": 92,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "mount_setattr": 442,
    "socket": 198,
    "shmget": 194,
    "shmat": 196,
}
# machine -> (AUDIT_ARCH_*, syscall table, first syscall number of the x32 ABI or None)
_ARCHES = {"x86_64": (0xC000003E, _X86_64, 0x40000000), "aarch64": (0xC00000B7, _AARCH64, None)}

_LD_W_ABS, _JEQ, _JGE, _RET = 0x20, 0x15, 0x35, 0x06
_ALLOW, _KILL_PROCESS = 0x7FFF0000, 0x80000000
_ERRNO = 0x00050000
_OFF_NR, _OFF_ARCH, _OFF_ARG0 = 0, 4, 16  # struct seccomp_data (args[0]'s low word: little endian)
_FAMILIES = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6


def program(machine: str | None = None) -> bytes | None:
    """The filter as ``struct sock_filter[]`` bytes, or None on an unsupported machine."""
    machine = machine or platform.machine()
    if machine not in _ARCHES:
        return None
    arch, table, x32 = _ARCHES[machine]
    # (code, jump-true target label or 0, jump-false target label or 0, k); labels resolved below
    ins: list[tuple[int, object, object, int]] = [
        (_LD_W_ABS, 0, 0, _OFF_ARCH),
        (_JEQ, 1, 0, arch),  # our ABI: skip the kill
        (_RET, 0, 0, _KILL_PROCESS),
        (_LD_W_ABS, 0, 0, _OFF_NR),
    ]
    if x32 is not None:
        ins.append((_JGE, "deny", 0, x32))
    ins += [(_JEQ, "deny", 0, table[name]) for name in DENIED]
    ins += [(_JEQ, 0, "allow", table["socket"]), (_LD_W_ABS, 0, 0, _OFF_ARG0)]
    ins += [(_JEQ, "allow", 0, fam) for fam in _FAMILIES]
    ins += [(_RET, 0, 0, _ERRNO | errno.EAFNOSUPPORT)]
    labels = {"allow": len(ins), "deny": len(ins) + 1}
    ins += [(_RET, 0, 0, _ALLOW), (_RET, 0, 0, _ERRNO | errno.EPERM)]
    out = bytearray()
    for i, (code, jt, jf, k) in enumerate(ins):
        jt_off = labels[jt] - i - 1 if isinstance(jt, str) else jt
        jf_off = labels[jf] - i - 1 if isinstance(jf, str) else jf
        out += struct.pack("<HBBI", code, jt_off, jf_off, k)
    return bytes(out)


_warned = False


def program_fd() -> int | None:
    """A fresh readable fd holding :func:`program` (bubblewrap reads it to the end), or None."""
    global _warned
    prog = program()
    if prog is None:
        if not _warned:
            log.warning(
                "no seccomp filter for %s: the code sandbox runs with namespaces and rlimits only", platform.machine()
            )
            _warned = True
        return None
    r, w = os.pipe()
    os.write(w, prog)  # a few hundred bytes: fits the pipe buffer
    os.close(w)
    return r
