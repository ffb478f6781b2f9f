//! Which CPU and node the calling thread runs on, without a syscall where the platform
//! allows: the rseq area glibc registers for every thread (the kernel writes `cpu_id`
//! and, since Linux 6.3, `node_id` there before the thread returns to user space), and
//! `getcpu` (through glibc, which calls the vDSO; the raw syscall where glibc has none).
//!
//! # References
//! - [`getcpu(2)`](https://man7.org/linux/man-pages/man2/getcpu.2.html)
//! - [`rseq(2)`](https://man7.org/linux/man-pages/man2/rseq.2.html), `include/uapi/linux/rseq.h`
//! - glibc's `__rseq_offset`, `__rseq_size` (since 2.35): `sys/rseq.h`

use core::ffi::{c_int, c_uint, c_void};
use core::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

use crate::Errno;

/// `getauxval` key of the kernel's rseq feature size (Linux 6.3+): how much of
/// `struct rseq` the kernel fills.
const AT_RSEQ_FEATURE_SIZE: libc::c_ulong = 27;
/// `offsetof(struct rseq, cpu_id)`.
const CPU_ID: usize = 4;
/// `offsetof(struct rseq, node_id)` (after `cpu_id_start`, `cpu_id`, `rseq_cs`, `flags`).
const NODE_ID: usize = 20;
/// `offsetofend(struct rseq, node_id)`: the kernel's feature size must reach this far
/// for `node_id` to be written.
const NODE_ID_END: libc::c_ulong = 24;

type GetcpuFn = unsafe extern "C" fn(*mut c_uint, *mut c_uint) -> c_int;

/// glibc's `getcpu`: 0 unresolved, 1 absent, else the function's address.
static GETCPU: AtomicUsize = AtomicUsize::new(0);

fn glibc_getcpu() -> Option<GetcpuFn> {
    let mut addr = GETCPU.load(Ordering::Relaxed);
    if addr == 0 {
        // SAFETY: a NUL-terminated name; RTLD_DEFAULT searches the loaded objects.
        let found = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"getcpu".as_ptr()) };
        addr = if found.is_null() { 1 } else { found as usize };
        GETCPU.store(addr, Ordering::Relaxed);
    }
    (addr != 1).then(|| {
        // SAFETY: the address of glibc's `int getcpu(unsigned *, unsigned *)` (since
        // 2.29), the signature of `GetcpuFn`.
        unsafe { core::mem::transmute::<usize, GetcpuFn>(addr) }
    })
}

/// `int getcpu(unsigned *cpu, unsigned *node)` — the CPU and node the calling thread
/// runs on: `(cpu, node)`. glibc answers from the vDSO (no syscall); without glibc's
/// wrapper the raw syscall.
///
/// The answer was true at some instant during the call; the thread may run elsewhere by
/// the time the caller uses it.
///
/// # Errors
/// The kernel's errno (none is documented for valid pointers).
#[inline]
pub fn getcpu() -> Result<(u32, u32), Errno> {
    let (mut cpu, mut node): (c_uint, c_uint) = (0, 0);
    let rc = match glibc_getcpu() {
        // SAFETY: two valid out-pointers.
        Some(f) => unsafe { f(&mut cpu, &mut node) },
        None => {
            // SAFETY: as above, through the raw syscall.
            let ret = unsafe {
                libc::syscall(
                    libc::SYS_getcpu,
                    &mut cpu as *mut c_uint,
                    &mut node as *mut c_uint,
                    core::ptr::null_mut::<c_void>(),
                )
            };
            ret as c_int
        }
    };
    if rc == -1 {
        // SAFETY: `__errno_location` returns this thread's errno slot, always valid.
        return Err(Errno::from_raw_os_error(unsafe {
            *libc::__errno_location()
        }));
    }
    Ok((cpu, node))
}

/// Where each thread's rseq area lives: glibc's `__rseq_offset` from the thread pointer,
/// found once. Only for registrations that cover `node_id` on a kernel that fills it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RseqArea {
    offset: isize,
}

impl RseqArea {
    /// The process's rseq area, if glibc registers one that the kernel fills up to
    /// `node_id`: glibc 2.35+ exports `__rseq_offset` and `__rseq_size` (looked up with
    /// `dlsym`, so that other C libraries simply have none), `__rseq_size` is not 0 (0:
    /// registration disabled), and the kernel's `AT_RSEQ_FEATURE_SIZE` (6.3+) is at
    /// least 24 (`node_id` and `mm_cid` came together: 28). `None` otherwise, or on an architecture whose thread pointer this crate
    /// does not read (x86_64 and aarch64 only).
    ///
    /// `__rseq_size` is not a registration length: glibc 2.35–2.39 say 20 (the fields
    /// they use, up to `node_id`) while registering 32 bytes, 2.40+ the kernel's feature size. Every
    /// successful registration is at least 32 bytes (the kernel refuses less,
    /// `ORIG_RSEQ_SIZE`), which covers `node_id` at 20..24, and a 6.3+ kernel writes it.
    pub fn find() -> Option<RseqArea> {
        if !cfg!(any(target_arch = "x86_64", target_arch = "aarch64")) {
            return None;
        }
        // SAFETY: NUL-terminated names; RTLD_DEFAULT searches the loaded objects.
        let (offset, size) = unsafe {
            (
                libc::dlsym(libc::RTLD_DEFAULT, c"__rseq_offset".as_ptr()),
                libc::dlsym(libc::RTLD_DEFAULT, c"__rseq_size".as_ptr()),
            )
        };
        if offset.is_null() || size.is_null() {
            return None;
        }
        // SAFETY: glibc defines `const ptrdiff_t __rseq_offset` and `const unsigned int
        // __rseq_size`, set before any user code runs and never changed after.
        let (offset, size) = unsafe { (*offset.cast::<isize>(), *size.cast::<c_uint>()) };
        // SAFETY: getauxval reads the auxiliary vector; an unknown key returns 0.
        let feature = unsafe { libc::getauxval(AT_RSEQ_FEATURE_SIZE) };
        (size > 0 && feature >= NODE_ID_END).then_some(RseqArea { offset })
    }

    /// The calling thread's `(cpu_id, node_id)` as the kernel last wrote them (on the
    /// thread's last return to user space: after any migration, before the thread runs
    /// on the new CPU). `None` when this thread's registration failed (glibc stores a
    /// negative `cpu_id` then).
    #[inline]
    pub fn read(self) -> Option<(u32, u32)> {
        let area = thread_pointer().wrapping_offset(self.offset);
        // SAFETY: glibc places every thread's `struct rseq` (32 bytes or more, aligned
        // to 32) at thread pointer + `__rseq_offset` for the thread's whole life, so
        // both fields are inside it and aligned. The kernel writes the
        // fields asynchronously to this thread's code (on return from the kernel), so
        // they are read as atomics, each one whole.
        let (cpu, node) = unsafe {
            (
                (*area.add(CPU_ID).cast::<AtomicU32>()).load(Ordering::Relaxed),
                (*area.add(NODE_ID).cast::<AtomicU32>()).load(Ordering::Relaxed),
            )
        };
        ((cpu as i32) >= 0).then_some((cpu, node))
    }
}

/// The calling thread's thread pointer (the TCB glibc places `struct rseq` beside).
#[cfg(target_arch = "x86_64")]
#[inline]
fn thread_pointer() -> *const u8 {
    let tp: *const u8;
    // SAFETY: on x86_64 Linux the TCB's first word holds its own address (the TLS ABI's
    // `tcbhead_t.tcb`), at %fs:0; reading it has no side effect.
    unsafe {
        core::arch::asm!(
            "mov {}, fs:0",
            out(reg) tp,
            options(nostack, readonly, preserves_flags, pure)
        );
    }
    tp
}

/// The calling thread's thread pointer (the TCB glibc places `struct rseq` beside).
#[cfg(target_arch = "aarch64")]
#[inline]
fn thread_pointer() -> *const u8 {
    let tp: *const u8;
    // SAFETY: TPIDR_EL0 holds the thread pointer; reading it has no side effect.
    unsafe {
        core::arch::asm!(
            "mrs {}, tpidr_el0",
            out(reg) tp,
            options(nostack, nomem, preserves_flags, pure)
        );
    }
    tp
}

/// No thread pointer read here: [`RseqArea::find`] returns `None`, so this is never used.
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn thread_pointer() -> *const u8 {
    core::ptr::null()
}
