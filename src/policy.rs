//! Memory policies, their flags, and the calling thread's policy.
//!
//! # Safety
//!
//! The thread-policy calls pass a mask this module sized itself; they change no memory.
#![allow(unsafe_code)]

use std::fmt;
use std::marker::PhantomData;

use numapin_sys as sys;

use crate::error::{Errno, Error, Result};
use crate::node::{KernelMask, Node, NodeSet, possible_node_count};
use crate::probe::{MempolicySupport, NumaCall};

/// A memory policy: where future page faults of a range (or a thread) allocate.
///
/// # Example
/// ```
/// use numapin::{MemPolicy, NodeSet};
/// let p = MemPolicy::Interleave(NodeSet::from_nodes([0, 1, 2]).unwrap());
/// assert_eq!(p.to_string(), "interleave:0-2");
/// assert!(MemPolicy::Bind(NodeSet::new()).validate().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[doc(alias = "mempolicy")]
pub enum MemPolicy {
    /// `MPOL_DEFAULT`: no policy of its own (a range falls back to the thread's policy,
    /// a thread to local allocation).
    Default,
    /// `MPOL_LOCAL`: the node of the faulting CPU.
    Local,
    /// `MPOL_PREFERRED`: this node while it has room, then others.
    Preferred(Node),
    /// `MPOL_PREFERRED_MANY`: these nodes while they have room (since Linux 5.15).
    PreferredMany(NodeSet),
    /// `MPOL_BIND`: only these nodes; the allocation fails (OOM) when they are full.
    Bind(NodeSet),
    /// `MPOL_INTERLEAVE`: page by page, round robin over these nodes.
    Interleave(NodeSet),
    /// `MPOL_WEIGHTED_INTERLEAVE`: by the weights in
    /// `/sys/kernel/mm/mempolicy/weighted_interleave/` (since Linux 6.9).
    WeightedInterleave(NodeSet),
}

bitflags::bitflags! {
    /// Mode flags OR-ed into the mode (`set_mempolicy(2)`).
    /// `STATIC_NODES` and `RELATIVE_NODES` exclude each other.
    #[repr(transparent)]
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct ModeFlags: i32 {
        /// `MPOL_F_STATIC_NODES`: keep the node ids when the cpuset changes (since Linux 2.6.26).
        const STATIC_NODES = sys::MPOL_F_STATIC_NODES;
        /// `MPOL_F_RELATIVE_NODES`: ids relative to the allowed set (since Linux 2.6.26).
        const RELATIVE_NODES = sys::MPOL_F_RELATIVE_NODES;
        /// `MPOL_F_NUMA_BALANCING`: allow NUMA balancing under `Bind` (since Linux 5.12;
        /// `Preferred`/`PreferredMany` since 6.x).
        const NUMA_BALANCING = sys::MPOL_F_NUMA_BALANCING;
        const _ = !0;
    }
}

bitflags::bitflags! {
    /// Flags of `mbind(2)`. Binding a fresh mapping before its first write needs none of
    /// them: a policy steers future faults; `MOVE` is for pages that already exist.
    #[repr(transparent)]
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct MbindFlags: u32 {
        /// `MPOL_MF_STRICT`: fail with `EIO` if existing pages are elsewhere (and, with
        /// `MOVE`, could not be moved).
        const STRICT = sys::MPOL_MF_STRICT;
        /// `MPOL_MF_MOVE`: move this process's existing pages of the range.
        const MOVE = sys::MPOL_MF_MOVE;
        /// `MPOL_MF_MOVE_ALL`: also pages shared with other processes; needs
        /// `CAP_SYS_NICE` (else `EPERM`, which here is an error, not a degradation).
        const MOVE_ALL = sys::MPOL_MF_MOVE_ALL;
        const _ = !0;
    }
}

/// Why placement is unavailable here. Only these two errnos degrade; everything else
/// is an [`Error`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
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

/// The outcome of setting a policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[must_use = "a Degraded placement means memory is not where it was asked to be"]
pub enum Placement {
    /// The kernel accepted the policy.
    Bound,
    /// The kernel refused with `EPERM` or `ENOSYS`: memory works, unplaced.
    Degraded(DegradeReason),
}

impl Placement {
    /// Whether the policy is in force.
    pub fn is_bound(&self) -> bool {
        matches!(self, Placement::Bound)
    }

    /// Turns a policy call's result into a placement, judging its errno with
    /// [`degrade_or_error`].
    pub(crate) fn from_call(
        call: NumaCall,
        result: std::result::Result<(), Errno>,
        args: impl FnOnce() -> String,
    ) -> Result<Placement> {
        match result {
            Ok(()) => Ok(Placement::Bound),
            Err(errno) => degrade_or_error(call, errno, args).map(Placement::Degraded),
        }
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Bound => f.write_str("bound"),
            Placement::Degraded(reason) => write!(f, "degraded: {reason}"),
        }
    }
}

/// A query answered by the kernel, or not available here (`EPERM`/`ENOSYS`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observed<T> {
    /// The kernel's answer.
    Known(T),
    /// The query is denied or unsupported here.
    Degraded(DegradeReason),
}

impl<T> Observed<T> {
    /// The answer, if there is one.
    pub fn known(self) -> Option<T> {
        match self {
            Observed::Known(t) => Some(t),
            Observed::Degraded(_) => None,
        }
    }
}

impl MemPolicy {
    /// The kernel mode number (`MPOL_*`).
    pub fn mode(&self) -> i32 {
        match self {
            MemPolicy::Default => sys::MPOL_DEFAULT,
            MemPolicy::Local => sys::MPOL_LOCAL,
            MemPolicy::Preferred(_) => sys::MPOL_PREFERRED,
            MemPolicy::PreferredMany(_) => sys::MPOL_PREFERRED_MANY,
            MemPolicy::Bind(_) => sys::MPOL_BIND,
            MemPolicy::Interleave(_) => sys::MPOL_INTERLEAVE,
            MemPolicy::WeightedInterleave(_) => sys::MPOL_WEIGHTED_INTERLEAVE,
        }
    }

    /// The policy's nodes (empty for `Default` and `Local`).
    pub fn nodes(&self) -> NodeSet {
        match self {
            MemPolicy::Default | MemPolicy::Local => NodeSet::new(),
            MemPolicy::Preferred(n) => std::iter::once(*n).collect(),
            MemPolicy::PreferredMany(s)
            | MemPolicy::Bind(s)
            | MemPolicy::Interleave(s)
            | MemPolicy::WeightedInterleave(s) => *s,
        }
    }

    /// Checks what the kernel would reject with a bare `EINVAL`, and says why.
    ///
    /// # Errors
    /// A node-set policy with an empty set.
    pub fn validate(&self) -> Result<()> {
        match self {
            MemPolicy::PreferredMany(s)
            | MemPolicy::Bind(s)
            | MemPolicy::Interleave(s)
            | MemPolicy::WeightedInterleave(s)
                if s.is_empty() =>
            {
                Err(Error::invalid(
                    "MemPolicy",
                    format!("{} needs at least one node; the set is empty", self.name()),
                ))
            }
            _ => Ok(()),
        }
    }

    /// The name numa_maps uses for the mode.
    pub fn name(&self) -> &'static str {
        match self {
            MemPolicy::Default => "default",
            MemPolicy::Local => "local",
            MemPolicy::Preferred(_) => "prefer",
            MemPolicy::PreferredMany(_) => "prefer (many)",
            MemPolicy::Bind(_) => "bind",
            MemPolicy::Interleave(_) => "interleave",
            MemPolicy::WeightedInterleave(_) => "weighted interleave",
        }
    }

    /// The kernel mask for this policy (all zero for `Default`/`Local`).
    pub(crate) fn kernel_mask(&self) -> KernelMask {
        self.nodes().as_kernel_mask()
    }

    /// Decodes what `get_mempolicy` returned.
    ///
    /// # Errors
    /// A mode this crate does not know.
    pub fn from_kernel(mode: i32, nodes: NodeSet) -> Result<(MemPolicy, ModeFlags)> {
        let flags = ModeFlags::from_bits_retain(mode & sys::MPOL_MODE_FLAGS);
        let policy = match mode & !sys::MPOL_MODE_FLAGS {
            sys::MPOL_DEFAULT => MemPolicy::Default,
            sys::MPOL_LOCAL => MemPolicy::Local,
            // An empty preferred mask is the pre-3.8 spelling of local allocation.
            sys::MPOL_PREFERRED => nodes
                .iter()
                .next()
                .map_or(MemPolicy::Local, MemPolicy::Preferred),
            sys::MPOL_PREFERRED_MANY => MemPolicy::PreferredMany(nodes),
            sys::MPOL_BIND => MemPolicy::Bind(nodes),
            sys::MPOL_INTERLEAVE => MemPolicy::Interleave(nodes),
            sys::MPOL_WEIGHTED_INTERLEAVE => MemPolicy::WeightedInterleave(nodes),
            other => {
                return Err(Error::invalid(
                    "get_mempolicy",
                    format!("the kernel reported mode {other}, which this crate does not know"),
                ));
            }
        };
        Ok((policy, flags))
    }
}

impl fmt::Display for MemPolicy {
    /// numa_maps style: `bind:0-2`, `prefer:1`, `default`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemPolicy::Default | MemPolicy::Local => f.write_str(self.name()),
            _ => write!(f, "{}:{}", self.name(), self.nodes()),
        }
    }
}

/// The calling thread's policy (`get_mempolicy(2)` with no flags).
///
/// # Errors
/// Any errno but `EPERM`/`ENOSYS` (which give [`Observed::Degraded`]).
///
/// # Example
/// ```
/// use numapin::{policy, Observed};
/// match policy::thread_policy().unwrap() {
///     Observed::Known((p, _flags)) => println!("this thread: {p}"),
///     Observed::Degraded(why) => println!("no NUMA here: {why}"),
/// }
/// ```
#[doc(alias = "get_mempolicy")]
pub fn thread_policy() -> Result<Observed<(MemPolicy, ModeFlags)>> {
    let mut mode: i32 = 0;
    let mut mask = KernelMask::empty(possible_node_count());
    let maxnode = mask.maxnode();
    // SAFETY: `mode` is a valid out-pointer and `mask` holds `maxnode / 64` words.
    let result = unsafe {
        sys::get_mempolicy(
            &mut mode,
            mask.words_mut().as_mut_ptr(),
            maxnode,
            std::ptr::null_mut(),
            0,
        )
    };
    match result {
        Ok(()) => {
            let nodes = NodeSet::from_kernel_words(mask.words());
            MemPolicy::from_kernel(mode, nodes).map(Observed::Known)
        }
        Err(errno) => degrade_or_error(NumaCall::GetMempolicy, errno, || {
            format!("maxnode={maxnode}")
        })
        .map(Observed::Degraded),
    }
}

/// Sets the calling thread's policy (`set_mempolicy(2)`); it steers the thread's future
/// page faults in memory without a range policy.
///
/// # Errors
/// An empty set for a node-set policy (checked first), or any errno but `EPERM`/`ENOSYS`
/// (which give [`Placement::Degraded`]).
#[doc(alias = "set_mempolicy")]
pub fn set_thread_policy(policy: &MemPolicy) -> Result<Placement> {
    set_thread_policy_with(policy, ModeFlags::empty())
}

/// [`set_thread_policy`] with mode flags.
///
/// # Errors
/// As [`set_thread_policy`].
pub fn set_thread_policy_with(policy: &MemPolicy, flags: ModeFlags) -> Result<Placement> {
    policy.validate()?;
    let mask = policy.kernel_mask();
    let mode = policy.mode() | flags.bits();
    // SAFETY: `mask` holds `maxnode / 64` words, more than the kernel reads.
    let result = unsafe { sys::set_mempolicy(mode, mask.words().as_ptr(), mask.maxnode()) };
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
/// use numapin::{policy, MemPolicy, NodeSet};
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
