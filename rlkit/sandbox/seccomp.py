"""The code sandbox's seccomp filter: the system calls code under test never needs, denied before
it starts (bubblewrap loads the filter: `rlkit.sandbox.programs`)."""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile

# What code under test never needs and a sandbox must not reach (denied with EPERM by a seccomp
# filter bubblewrap loads before the program starts): the kernel keyring (the driver's session
# keyring, keys that outlive the run), new namespaces and mounts (a tmpfs or cgroup2 mounted in a
# nested user namespace is memory past every limit, and cgroup.kill), and the kernel's debugging,
# tracing, module and io_uring interfaces.
DENIED_SYSCALLS = (
    "keyctl", "add_key", "request_key",
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr",
    "bpf", "perf_event_open", "ptrace", "process_vm_readv", "process_vm_writev", "userfaultfd",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "swapon", "swapoff",
    "reboot", "acct", "quotactl", "open_by_handle_at", "name_to_handle_at", "syslog",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "memfd_create", "memfd_secret",  # memory files: each up to the file-size limit, outside the address-space one
    "shmget", "msgget", "semget",  # SysV IPC objects: memory outside every process's bound, and they outlive it
    "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr")  # POSIX queues: too
# clone(2)'s namespace flags (NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET): each refused
CLONE_NAMESPACES = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)


# Without namespaces ("process" mode) the host's network and processes are in reach too: no socket
# at all (socketpair stays), no signal but to its own process group (kill(0, sig)), no leaving its
# session or process group (so killing the group ends all it started).
PROCESS_DENIED = ("socket", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "pidfd_open",
                  "pidfd_send_signal", "pidfd_getfd", "setsid", "setpgid")


@functools.lru_cache(maxsize=2)
def seccomp_filter(process: bool = False) -> bytes:
    """The sandbox's seccomp filter as the BPF program bubblewrap's `--seccomp` (or, with
    ``process``, the runner itself) loads (libseccomp, through pyseccomp): everything allowed but
    `DENIED_SYSCALLS` and clone(2) into new namespaces, and with ``process`` also `PROCESS_DENIED`
    and kill(2) of anything but its own process group; clone3, whose flags a filter cannot read,
    answers ENOSYS, so the C library falls back to clone."""
    import errno

    import pyseccomp

    f = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    for name in DENIED_SYSCALLS + (PROCESS_DENIED if process else ()):
        with contextlib.suppress(RuntimeError, ValueError):  # a syscall this architecture lacks
            f.add_rule(pyseccomp.ERRNO(errno.EPERM), name)
    for flag in CLONE_NAMESPACES:
        f.add_rule(pyseccomp.ERRNO(errno.EPERM), "clone", pyseccomp.Arg(0, pyseccomp.MASKED_EQ, flag, flag))
    f.add_rule(pyseccomp.ERRNO(errno.ENOSYS), "clone3")
    if process:
        f.add_rule(pyseccomp.ERRNO(errno.EPERM), "kill", pyseccomp.Arg(0, pyseccomp.NE, 0))
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        return out.read()


def filter_fd() -> int:
    """A file descriptor holding the seccomp filter, for bubblewrap to read (closed by the caller)."""
    fd = os.memfd_create("rlkit-seccomp", 0)
    os.write(fd, seccomp_filter())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
