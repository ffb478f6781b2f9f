//! The calling thread's policy (`set_mempolicy`, `get_mempolicy`), the scoped guard that
//! restores it, and the one decoder of what `get_mempolicy` answers (for a thread or a
//! range).

use std::marker::PhantomData;

use numapin_sys as sys;

use super::{MemPolicy, ModeFlags, Observed, Placement, check_policy_call, not_allowed};
use crate::calls::{NumaCall, degrade_or_error};
use crate::error::{Errno, Result};
use crate::node::{KernelMask, NodeSet, possible_node_count};

/// The calling thread's policy (`get_mempolicy(2)` with no flags).
///
/// # Errors
/// Any errno but `EPERM`/`ENOSYS` (which give [`Observed::Degraded`]).
///
/// # Example
/// ```
/// use numapin::policy::{self, Observed};
/// match policy::thread_policy().unwrap() {
///     Observed::Known((p, _flags)) => println!("this thread: {p}"),
///     Observed::Degraded(why) => println!("no NUMA here: {why}"),
/// }
/// ```
#[doc(alias = "get_mempolicy")]
pub fn thread_policy() -> Result<Observed<(MemPolicy, ModeFlags)>> {
    // SAFETY: a null address with no flags reads the calling thread's policy.
    unsafe { get_policy(std::ptr::null_mut(), 0) }
}

/// The policy of the range holding `addr` (`get_mempolicy` with `MPOL_F_ADDR`).
///
/// # Safety
/// `addr` must be an address of this process the caller owns (else the kernel answers
/// `EFAULT`, which is returned as an error).
///
/// # Errors
/// As [`thread_policy`].
pub(crate) unsafe fn policy_at_addr(
    addr: *mut std::ffi::c_void,
) -> Result<Observed<(MemPolicy, ModeFlags)>> {
    // SAFETY: forwarded from the caller.
    unsafe { get_policy(addr, sys::MPOL_F_ADDR) }
}

/// `get_mempolicy` for the thread (`addr` null, `flags` 0) or a range (`MPOL_F_ADDR`),
/// decoded: the one place that turns the kernel's mode and mask into a [`MemPolicy`].
///
/// # Safety
/// With `MPOL_F_ADDR`, `addr` must be an address of this process the caller owns.
unsafe fn get_policy(
    addr: *mut std::ffi::c_void,
    flags: std::ffi::c_ulong,
) -> Result<Observed<(MemPolicy, ModeFlags)>> {
    let mut mode: i32 = 0;
    let mut mask = KernelMask::empty(possible_node_count());
    let maxnode = mask.maxnode();
    // SAFETY: `mode` is a valid out-pointer and `mask` holds `maxnode / 64` words; the
    // caller vouches for `addr`.
    let result = unsafe {
        sys::get_mempolicy(
            &mut mode,
            mask.words_mut().as_mut_ptr(),
            maxnode,
            addr,
            flags,
        )
    };
    match result {
        Ok(()) => {
            let nodes = NodeSet::from_kernel_words(mask.words());
            MemPolicy::from_kernel(mode, nodes).map(Observed::Known)
        }
        Err(errno) => degrade_or_error(NumaCall::GetMempolicy, errno, || {
            format!("addr={addr:p} flags={flags:#x} maxnode={maxnode}")
        })
        .map(Observed::Degraded),
    }
}

/// Sets the calling thread's policy (`set_mempolicy(2)`); it steers the thread's future
/// page faults in memory without a range policy.
///
/// # Errors
/// Checked first, in every environment: an empty set for a node-set policy, a node this
/// machine cannot have, mode flags the kernel refuses, a policy with no node this process
/// may allocate on ([`Error::NodeNotAllowed`](crate::error::Error::NodeNotAllowed)).
/// Then any errno but `EPERM`/`ENOSYS` (which give [`Placement::Degraded`]).
#[doc(alias = "set_mempolicy")]
pub fn set_thread_policy(policy: &MemPolicy) -> Result<Placement> {
    set_thread_policy_with(policy, ModeFlags::empty())
}

/// [`set_thread_policy`] with mode flags.
///
/// # Errors
/// As [`set_thread_policy`].
pub fn set_thread_policy_with(policy: &MemPolicy, flags: ModeFlags) -> Result<Placement> {
    check_policy_call("set_mempolicy", policy, flags)?;
    let mask = policy.kernel_mask();
    let mode = policy.mode() | flags.bits();
    // SAFETY: `mask` holds `maxnode / 64` words, more than the kernel reads.
    let result = unsafe { sys::set_mempolicy(mode, mask.words().as_ptr(), mask.maxnode()) };
    if result == Err(Errno::INVAL)
        && let Some(e) = not_allowed("set_mempolicy", policy, flags)
    {
        return Err(e);
    }
    Placement::from_call(NumaCall::SetMempolicy, result, || {
        format!("policy={policy} flags={flags:?} maxnode={}", mask.maxnode())
    })
}

/// Sets the thread's policy until the guard drops, then restores the previous one
/// (also when the scope unwinds from a panic).
///
/// # Errors
/// As [`set_thread_policy`], or reading the current policy fails.
///
/// # Example
/// ```
/// use numapin::NodeSet;
/// use numapin::policy::{self, MemPolicy};
/// let nodes = NodeSet::allowed().unwrap();
/// {
///     let guard = policy::scoped(&MemPolicy::Interleave(nodes)).unwrap();
///     // Pages this thread faults in here are interleaved (unless guard.placement()
///     // says the container denies placement).
///     let _ = guard.placement();
/// } // the previous policy is back
/// ```
pub fn scoped(policy: &MemPolicy) -> Result<ScopedPolicy> {
    let previous = match thread_policy()? {
        Observed::Known(previous) => previous,
        Observed::Degraded(reason) => {
            return Ok(ScopedPolicy {
                previous: None,
                placement: Placement::Degraded(reason),
                _not_send: PhantomData,
            });
        }
    };
    let placement = set_thread_policy(policy)?;
    Ok(ScopedPolicy {
        previous: placement.is_bound().then_some(previous),
        placement,
        _not_send: PhantomData,
    })
}

/// Restores the thread's previous policy on drop. Not `Send`: a thread policy belongs to
/// the thread that set it.
#[must_use = "the previous policy is restored when the guard drops"]
pub struct ScopedPolicy {
    previous: Option<(MemPolicy, ModeFlags)>,
    placement: Placement,
    _not_send: PhantomData<*const ()>,
}

impl ScopedPolicy {
    /// Whether the scoped policy is in force.
    pub fn placement(&self) -> Placement {
        self.placement
    }
}

impl Drop for ScopedPolicy {
    fn drop(&mut self) {
        if let Some((policy, flags)) = self.previous.take() {
            // The previous policy was accepted by this kernel moments ago; if restoring
            // it fails anyway there is nobody to report to from a destructor, and the
            // thread keeps the scoped policy, which is a placement, not a safety, issue.
            let _ = set_thread_policy_with(&policy, flags);
        }
    }
}
