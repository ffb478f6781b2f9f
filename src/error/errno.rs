//! What an errno is called and what it means for the call that got it.

use super::Errno;

pub(super) fn errno_name(errno: Errno) -> &'static str {
    match errno {
        Errno::PERM => "EPERM",
        Errno::NOENT => "ENOENT",
        Errno::SRCH => "ESRCH",
        Errno::IO => "EIO",
        Errno::NOMEM => "ENOMEM",
        Errno::ACCESS => "EACCES",
        Errno::FAULT => "EFAULT",
        Errno::BUSY => "EBUSY",
        Errno::XDEV => "EXDEV",
        Errno::INVAL => "EINVAL",
        Errno::NOSYS => "ENOSYS",
        Errno::AGAIN => "EAGAIN",
        Errno::OVERFLOW => "EOVERFLOW",
        Errno::NODEV => "ENODEV",
        _ => "errno",
    }
}

/// What an errno means for the NUMA calls, not the generic strerror.
pub(super) fn errno_meaning(op: &str, errno: Errno) -> &'static str {
    match (op, errno) {
        ("mbind", Errno::INVAL) => {
            "unaligned address, unknown mode or flags, a mask that is empty after removing \
             nodes without memory or outside mems_allowed, or mode flags the mode cannot take"
        }
        ("mbind", Errno::FAULT) => "part of the range is not mapped",
        ("mbind", Errno::IO) => "MPOL_MF_STRICT: existing pages are on other nodes",
        ("mbind" | "munmap" | "mmap" | "madvise", Errno::NOMEM) => {
            "out of memory or out of mappings: splitting a VMA needs a map slot \
             (see vm.max_map_count)"
        }
        ("set_mempolicy" | "get_mempolicy", Errno::INVAL) => {
            "unknown mode or flags, a mask empty after removing unusable nodes, or maxnode \
             below the kernel's possible node count"
        }
        ("move_pages", Errno::NODEV) => "a target node is not online",
        ("mallctl", Errno::PERM) => {
            "jemalloc refused a read or write through a void key: this key takes no \
             old or new value (pass NULL pointers)"
        }
        ("mallctl", Errno::NOENT) => "jemalloc has no such key (or it is not compiled in)",
        ("mallctl", Errno::INVAL) => "jemalloc: wrong value size or value for this key",
        ("mallctl", Errno::AGAIN) => "jemalloc: a temporary failure, try again",
        ("mlock", Errno::NOMEM) => "RLIMIT_MEMLOCK reached, or part of the range is not mapped",
        (_, Errno::PERM) => {
            "not permitted (a seccomp profile, or a missing capability such as CAP_SYS_NICE)"
        }
        (_, Errno::NOSYS) => "the kernel does not implement this call (built without CONFIG_NUMA?)",
        (_, Errno::NOMEM) => "out of memory",
        (_, Errno::INVAL) => "invalid argument",
        (_, Errno::FAULT) => "bad address",
        _ => "see the man page",
    }
}
