//! Which NUMA syscall families work in this process, probed once each in a form that
//! needs no capability, and the one rule that turns their errnos into "degrade" or
//! "error". Below `policy`, `probe` and `region`, which all ask it.
//!
//! # Safety
//!
//! The probes map one page of their own, ask `mbind` and `move_pages` about it and unmap
//! it; `migrate_pages` is asked with empty node masks, which moves nothing.
#![allow(unsafe_code)]

use std::fmt;
use std::sync::OnceLock;

use numapin_sys as sys;

use crate::error::{Errno, Error, Result};
use crate::node::KernelMask;

/// Why placement is unavailable here. Only these two errnos degrade; everything else
/// is an [`Error`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "lowercase")
)]
pub enum DegradeReason {
    /// `EPERM`: a seccomp profile (Docker's default without `CAP_SYS_NICE`) denies the
    /// NUMA syscalls.
    Denied,
    /// `ENOSYS`: the kernel has no NUMA support (`CONFIG_NUMA=n`).
    Unsupported,
}

impl DegradeReason {
    /// The errno this reason stands for.
    pub fn errno(self) -> Errno {
        match self {
            DegradeReason::Denied => Errno::PERM,
            DegradeReason::Unsupported => Errno::NOSYS,
        }
    }

    /// `Some` for `EPERM` and `ENOSYS`, the two errnos that can mean "no placement here".
    /// The errno alone does not decide it: an `EPERM` where the probe found the call
    /// allowed is a missing capability, which numapin's own calls report as
    /// [`Error::MissingCapability`].
    pub fn from_errno(errno: Errno) -> Option<Self> {
        match errno {
            Errno::PERM => Some(DegradeReason::Denied),
            Errno::NOSYS => Some(DegradeReason::Unsupported),
            _ => None,
        }
    }
}

impl fmt::Display for DegradeReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DegradeReason::Denied => {
                "NUMA syscalls denied (EPERM): a seccomp profile such as Docker's default \
                 without CAP_SYS_NICE; memory runs unplaced"
            }
            DegradeReason::Unsupported => {
                "NUMA syscalls unsupported (ENOSYS): kernel built without CONFIG_NUMA; \
                 memory runs unplaced"
            }
        })
    }
}

/// Whether a group of NUMA syscalls works in this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "lowercase")
)]
pub enum MempolicySupport {
    /// The call answered its capability-free probe.
    Available,
    /// `EPERM`: denied whatever the arguments (a container's seccomp profile).
    Denied,
    /// `ENOSYS`: the kernel has no NUMA support.
    Unsupported,
}

impl MempolicySupport {
    /// The degradation this state implies, if any.
    pub fn degrade_reason(self) -> Option<DegradeReason> {
        match self {
            MempolicySupport::Available => None,
            MempolicySupport::Denied => Some(DegradeReason::Denied),
            MempolicySupport::Unsupported => Some(DegradeReason::Unsupported),
        }
    }

    fn from_probe(result: std::result::Result<(), Errno>) -> std::result::Result<Self, Errno> {
        match result {
            Ok(()) => Ok(MempolicySupport::Available),
            Err(Errno::PERM) => Ok(MempolicySupport::Denied),
            Err(Errno::NOSYS) => Ok(MempolicySupport::Unsupported),
            Err(e) => Err(e),
        }
    }
}

/// The NUMA syscalls, grouped as container profiles gate them.
///
/// Docker's default seccomp profile (moby `profiles/seccomp/default.json`) allows the
/// policy calls only with `CAP_SYS_NICE` and the page calls never: with
/// `--cap-add SYS_NICE` binding works while `move_pages` and `migrate_pages` get `EPERM`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SyscallGroup {
    /// `mbind`, `set_mempolicy`, `get_mempolicy`, `set_mempolicy_home_node`.
    Policy,
    /// `move_pages`, `migrate_pages`.
    Pages,
}

/// One probed syscall: what judges an errno from a real call (see
/// [`crate::calls::degrade_or_error`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NumaCall {
    Mbind,
    SetMempolicy,
    GetMempolicy,
    MovePages,
    MigratePages,
}

impl NumaCall {
    /// The C name.
    pub(crate) fn name(self) -> &'static str {
        match self {
            NumaCall::Mbind => "mbind",
            NumaCall::SetMempolicy => "set_mempolicy",
            NumaCall::GetMempolicy => "get_mempolicy",
            NumaCall::MovePages => "move_pages",
            NumaCall::MigratePages => "migrate_pages",
        }
    }

    /// What the probe found for this call: the policy calls share `mbind`'s probe (a
    /// profile gates them together); each page call has its own.
    ///
    /// # Errors
    /// The probe met an errno other than `EPERM`/`ENOSYS`.
    pub(crate) fn support(self) -> Result<MempolicySupport> {
        match self {
            NumaCall::Mbind | NumaCall::SetMempolicy | NumaCall::GetMempolicy => {
                mempolicy_support()
            }
            NumaCall::MovePages => move_pages_support(),
            NumaCall::MigratePages => migrate_pages_support(),
        }
    }
}

/// Runs a probe once per process and keeps its answer.
fn once(
    cell: &'static OnceLock<std::result::Result<MempolicySupport, Errno>>,
    probe: fn() -> std::result::Result<MempolicySupport, Errno>,
    op: &'static str,
    args: &'static str,
) -> Result<MempolicySupport> {
    cell.get_or_init(probe)
        .map_err(|errno| Error::os(op, errno, format_args!("probe: {args}")))
}

/// Whether the policy calls work here: probed once per process, with
/// `mbind(MPOL_DEFAULT)` on a page-aligned page of its own (an unaligned address is
/// `EINVAL`, which must never pass for "no NUMA").
///
/// # Errors
/// An errno other than `EPERM`/`ENOSYS` from the probe: that is a bug or a kernel
/// this crate does not understand, not a state.
pub fn mempolicy_support() -> Result<MempolicySupport> {
    static SUPPORT: OnceLock<std::result::Result<MempolicySupport, Errno>> = OnceLock::new();
    once(
        &SUPPORT,
        probe_mbind,
        "mbind",
        "one page-aligned anonymous page, MPOL_DEFAULT, no mask, flags 0",
    )
}

/// Whether the page calls (`move_pages`, `migrate_pages`) work here, each probed once in
/// a form that needs no capability. `Available` only when both are; otherwise the
/// stronger refusal of the two (`Unsupported` over `Denied`).
///
/// # Errors
/// An errno from a probe that no state explains.
pub fn page_calls_support() -> Result<MempolicySupport> {
    Ok(move_pages_support()?.max(migrate_pages_support()?))
}

/// The support of a whole [`SyscallGroup`].
///
/// # Errors
/// As [`mempolicy_support`] and [`page_calls_support`].
pub fn group_support(group: SyscallGroup) -> Result<MempolicySupport> {
    match group {
        SyscallGroup::Policy => mempolicy_support(),
        SyscallGroup::Pages => page_calls_support(),
    }
}

fn move_pages_support() -> Result<MempolicySupport> {
    static SUPPORT: OnceLock<std::result::Result<MempolicySupport, Errno>> = OnceLock::new();
    once(
        &SUPPORT,
        probe_move_pages,
        "move_pages",
        "pid 0, one page of its own, no target nodes (a query), flags 0",
    )
}

fn migrate_pages_support() -> Result<MempolicySupport> {
    static SUPPORT: OnceLock<std::result::Result<MempolicySupport, Errno>> = OnceLock::new();
    once(
        &SUPPORT,
        probe_migrate_pages,
        "migrate_pages",
        "pid 0, empty old and new masks (EINVAL after the permission checks)",
    )
}

/// Maps one private page, hands it to `probe`, unmaps it.
fn with_probe_page(
    probe: impl FnOnce(*mut std::ffi::c_void, usize) -> std::result::Result<(), Errno>,
) -> std::result::Result<(), Errno> {
    let page = crate::page::page_size();
    // SAFETY: a fresh private page, unmapped below; nothing else refers to it.
    let ptr = unsafe {
        rustix::mm::mmap_anonymous(
            std::ptr::null_mut(),
            page,
            rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
            rustix::mm::MapFlags::PRIVATE,
        )
    }?;
    let result = probe(ptr, page);
    // SAFETY: unmapping the page mapped above, referenced by nothing.
    let _ = unsafe { rustix::mm::munmap(ptr, page) };
    result
}

fn probe_mbind() -> std::result::Result<MempolicySupport, Errno> {
    MempolicySupport::from_probe(with_probe_page(|ptr, page| {
        // SAFETY: our own page-aligned page; MPOL_DEFAULT with a null mask changes nothing.
        unsafe { sys::mbind(ptr, page, sys::MPOL_DEFAULT, std::ptr::null(), 0, 0) }
    }))
}

/// `move_pages` with no target nodes is a query of where the page is: no capability is
/// checked (only `MPOL_MF_MOVE_ALL` and another process's pages need one).
fn probe_move_pages() -> std::result::Result<MempolicySupport, Errno> {
    MempolicySupport::from_probe(with_probe_page(|ptr, _| {
        let pages = [ptr];
        let mut status = [0i32; 1];
        // SAFETY: one page of our own, one status slot; a query moves nothing.
        unsafe {
            sys::move_pages(
                0,
                1,
                pages.as_ptr(),
                std::ptr::null(),
                status.as_mut_ptr(),
                0,
            )
        }
        .map(drop)
    }))
}

/// `migrate_pages(0, maxnode, {}, {})`: the kernel (`kernel_migrate_pages` in
/// mm/mempolicy.c) reads both masks, checks that this process may touch itself and that
/// the new nodes are a subset of its cpuset (the empty set is, so `CAP_SYS_NICE` is
/// never asked), then finds the new set empty and answers `EINVAL` without moving
/// anything. So `EINVAL` here means "available"; a seccomp filter answers before the
/// kernel looks at the arguments.
fn probe_migrate_pages() -> std::result::Result<MempolicySupport, Errno> {
    let empty = KernelMask::empty(crate::node::possible_node_count());
    let (old, new) = (empty, empty);
    // SAFETY: both masks hold `maxnode / 64` words; empty masks move nothing.
    let result =
        unsafe { sys::migrate_pages(0, old.maxnode(), old.words().as_ptr(), new.words().as_ptr()) };
    MempolicySupport::from_probe(match result {
        Ok(_) | Err(Errno::INVAL) => Ok(()),
        Err(e) => Err(e),
    })
}

/// Whether this kernel names anonymous mappings (`PR_SET_VMA_ANON_NAME`, Linux 5.17 with
/// `CONFIG_ANON_VMA_NAME`): asked once, with a fixed good name on a probe page. `EINVAL`
/// there means "not built in"; any other refusal (a seccomp profile's `EPERM`, say) also
/// means names are not to be had.
pub fn anon_vma_names_supported() -> bool {
    static WORKS: OnceLock<bool> = OnceLock::new();
    *WORKS.get_or_init(|| {
        with_probe_page(|ptr, page| {
            // SAFETY: our own fresh page and a NUL-terminated name; naming changes no memory.
            unsafe { sys::prctl_set_vma_anon_name(ptr, page, c"numapin probe".as_ptr()) }
        })
        .is_ok()
    })
}

pub(crate) fn populate_write_works() -> bool {
    static WORKS: OnceLock<bool> = OnceLock::new();
    *WORKS.get_or_init(|| {
        with_probe_page(|ptr, page| {
            // SAFETY: our own fresh page; populating keeps contents.
            unsafe { sys::madvise(ptr, page, sys::MADV_POPULATE_WRITE) }
        })
        .is_ok()
    })
}

/// What an errno from a NUMA call means here, given what the probe found for that call
/// (the one place that decides between "degrade" and "error"):
///
/// - `ENOSYS`: the kernel lacks the call: [`DegradeReason::Unsupported`].
/// - `EPERM` where the probe was denied too: a seccomp profile refuses the call whatever
///   its arguments: [`DegradeReason::Denied`].
/// - `EPERM` where the probe passed: the kernel's capability check refused this one
///   request (`CAP_SYS_NICE` for `MPOL_MF_MOVE_ALL`, another user's process, nodes
///   outside the target's cpuset; a capability held only in a child user namespace does
///   not count): [`Error::MissingCapability`].
/// - anything else: [`Error::Os`] with `args`.
///
/// # Errors
/// As above, or the probe itself failed.
pub(crate) fn degrade_or_error(
    call: NumaCall,
    errno: Errno,
    args: impl FnOnce() -> String,
) -> Result<DegradeReason> {
    let op = call.name();
    match (errno, call.support()?) {
        (Errno::NOSYS, _) => Ok(DegradeReason::Unsupported),
        (Errno::PERM, MempolicySupport::Denied) => Ok(DegradeReason::Denied),
        (Errno::PERM, MempolicySupport::Available) => Err(crate::capability::missing_sys_nice(
            op,
            format!(
                "the kernel refused {op}({}) with EPERM although its probe passed here, so this \
                 is its capability check (in the initial user namespace), not a seccomp profile",
                args()
            ),
        )),
        (errno, _) => Err(Error::os(op, errno, args())),
    }
}
