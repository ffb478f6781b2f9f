//! Progress of a layer's load, reported through a caller's hook at a bounded rate.
//!
//! The loaders count each finished slot under a short lock that never calls out. The
//! loader whose slot crosses the next [`PROGRESS_STEP`] then tries to take the hook lock
//! (`try_lock`): if another loader is inside the hook, it goes back to loading and the
//! other one's next report covers its bytes. A slow hook therefore holds up at most the
//! one loader that is calling it (all of the load when there is one loader thread), never
//! the others. Each call runs under `catch_unwind`; after a panic the hook is not called
//! again (it is marked in the hook, so no store calls it) and loading goes on. The panic's
//! payload is dropped under `catch_unwind` too (its `Drop` is the caller's code).

use std::any::Any;
use std::fmt;
use std::ops::ControlFlow;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Bytes loaded between two progress reports of one layer, at least: a layer of `n`
/// bytes gets at most `n / PROGRESS_STEP` reports before the final one.
pub const PROGRESS_STEP: u64 = 16 << 20;

/// Where a layer's load stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Progress {
    /// The reporting store's number in this process ([`PinStore::number`], the `<store>`
    /// of its regions' names). With `layer` it names one load where several stores share
    /// a hook: [`Checkpoint::place`] packs one store per tensor class and layout, each
    /// numbering its layers from 0 (a dense store's layers are its groups).
    ///
    /// [`PinStore::number`]: crate::store::PinStore::number
    /// [`Checkpoint::place`]: crate::model::Checkpoint::place
    pub store: u64,
    /// The layer being packed.
    pub layer: usize,
    /// Bytes copied into slots so far.
    pub bytes_done: u64,
    /// Bytes the layer loads in all.
    pub bytes_total: u64,
    /// Slots (one tensor of one expert) filled so far.
    pub slots_done: usize,
    /// Slots the layer fills in all.
    pub slots_total: usize,
}

impl Progress {
    /// Whether the layer is loaded (`bytes_done == bytes_total` and the same for slots).
    pub fn is_done(&self) -> bool {
        self.bytes_done == self.bytes_total && self.slots_done == self.slots_total
    }
}

/// A caller's progress hook for [`StoreOptions::progress`](crate::store::StoreOptions::progress).
///
/// Called from the loader threads, never under a lock the other loaders wait on; per
/// layer, the reports are monotonic, at least [`PROGRESS_STEP`] bytes apart, and the
/// last one has `bytes_done == bytes_total` and comes exactly once, after every slot is
/// filled and before `pack_layer` returns. Packs of different layers running at once
/// call the hook concurrently. A hook that panics is not called again (by any store;
/// [`ProgressHook::panicked`] tells); the load goes on and the store is unaffected.
///
/// Two hooks are equal when they are the same `Arc`.
///
/// # Example
/// ```
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use std::sync::Arc;
/// use numapin::store::{ExpertSource, LayerSpec, Layout, PinStore, ProgressHook, StoreOptions};
///
/// let last = Arc::new(AtomicU64::new(0));
/// let seen = last.clone();
/// let options = StoreOptions::default()
///     .progress(Some(ProgressHook::new(move |p| seen.store(p.bytes_done, Ordering::Relaxed))));
/// let store = PinStore::new(Layout::Unplaced, options)?;
/// let w = vec![1u8; 5000];
/// let sources = [ExpertSource::Memory { weights: &w, scales: &[] }];
/// store.pack_layer(0, &LayerSpec { experts: 1, weight_bytes: 5000, scale_bytes: 0 }, &sources)?;
/// assert_eq!(last.load(Ordering::Relaxed), 5000);
/// # Ok::<(), numapin::Error>(())
/// ```
#[derive(Clone)]
pub struct ProgressHook(Arc<Hook>);

/// The caller's closure: `Break` cancels the layer reported on.
type HookFn = dyn Fn(&Progress) -> ControlFlow<()> + Send + Sync;

struct Hook {
    call: Box<HookFn>,
    /// The hook panicked once: it is not called again, by any store.
    panicked: AtomicBool,
}

impl ProgressHook {
    /// Wraps a closure.
    pub fn new(hook: impl Fn(&Progress) + Send + Sync + 'static) -> Self {
        ProgressHook::cancellable(move |p| {
            hook(p);
            ControlFlow::Continue(())
        })
    }

    /// Wraps a closure that can stop the load: `ControlFlow::Break(())` cancels the
    /// layer being reported on. Its loaders take no new slot, and `pack_layer` returns
    /// [`Error::Cancelled`](crate::Error::Cancelled) without packing the layer (even
    /// after the final report, which comes before `pack_layer` would publish it); the
    /// store is as it was before the call. Other layers, and later loads, call the hook
    /// again. Bindings use this to stop a load when a caller's callback raises.
    pub fn cancellable(
        hook: impl Fn(&Progress) -> ControlFlow<()> + Send + Sync + 'static,
    ) -> Self {
        ProgressHook(Arc::new(Hook {
            call: Box::new(hook),
            panicked: AtomicBool::new(false),
        }))
    }

    /// Whether the hook panicked (it is then never called again).
    pub fn panicked(&self) -> bool {
        self.0.panicked.load(Ordering::Relaxed)
    }
}

impl fmt::Debug for ProgressHook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ProgressHook(..)")
    }
}

impl PartialEq for ProgressHook {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for ProgressHook {}

/// One layer's counters and its hook.
pub(crate) struct Meter<'h> {
    hook: &'h ProgressHook,
    store: u64,
    layer: usize,
    bytes_total: u64,
    slots_total: usize,
    /// (bytes, slots) done; held only to add and to read.
    done: Mutex<(u64, usize)>,
    /// The bytes of the last report; held while the hook runs, only ever `try_lock`ed
    /// by loaders.
    reporting: Mutex<u64>,
    /// A copy of the last report's bytes, read without the lock.
    last: AtomicU64,
    /// The hook returned `Break` for this layer: the loaders stop and the load fails.
    cancelled: AtomicBool,
}

impl<'h> Meter<'h> {
    /// Counts `store`'s load of `layer`: `bytes` in `slots` slots.
    pub(crate) fn new(
        hook: &'h ProgressHook,
        (store, layer): (u64, usize),
        bytes: u64,
        slots: usize,
    ) -> Self {
        Meter {
            hook,
            store,
            layer,
            bytes_total: bytes,
            slots_total: slots,
            done: Mutex::new((0, 0)),
            reporting: Mutex::new(0),
            last: AtomicU64::new(0),
            cancelled: AtomicBool::new(false),
        }
    }

    /// The layer this meter reports on.
    pub(crate) fn layer(&self) -> usize {
        self.layer
    }

    /// Whether the hook cancelled this layer's load.
    pub(crate) fn cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Relaxed)
    }

    fn snapshot(&self) -> (u64, usize) {
        *self.done.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A loader finished a slot of `bytes`.
    pub(crate) fn slot_done(&self, bytes: u64) {
        let (done, _) = {
            let mut d = self.done.lock().unwrap_or_else(|e| e.into_inner());
            d.0 += bytes;
            d.1 += 1;
            *d
        };
        if self.hook.panicked()
            || done.saturating_sub(self.last.load(Ordering::Relaxed)) < PROGRESS_STEP
        {
            return;
        }
        // Someone else is reporting: go back to loading.
        let Ok(mut last) = self.reporting.try_lock() else {
            return;
        };
        // Read again under the hook lock, so that reports never go backwards.
        let (bytes, slots) = self.snapshot();
        if bytes.saturating_sub(*last) < PROGRESS_STEP
            || (bytes, slots) == (self.bytes_total, self.slots_total)
        {
            return;
        }
        *last = bytes;
        self.last.store(bytes, Ordering::Relaxed);
        self.call(bytes, slots);
    }

    /// The final report, once every slot is filled.
    pub(crate) fn finish(&self) {
        let _last = self.reporting.lock().unwrap_or_else(|e| e.into_inner());
        self.call(self.bytes_total, self.slots_total);
    }

    fn call(&self, bytes_done: u64, slots_done: usize) {
        if self.hook.panicked() {
            return;
        }
        let progress = Progress {
            store: self.store,
            layer: self.layer,
            bytes_done,
            bytes_total: self.bytes_total,
            slots_done,
            slots_total: self.slots_total,
        };
        // The hook sees only `&Progress`; a panic leaves nothing of ours half-updated.
        match catch_unwind(AssertUnwindSafe(|| (self.hook.0.call)(&progress))) {
            Ok(ControlFlow::Continue(())) => {}
            Ok(ControlFlow::Break(())) => self.cancelled.store(true, Ordering::Relaxed),
            Err(payload) => {
                self.hook.0.panicked.store(true, Ordering::Relaxed);
                drop_payload(payload);
            }
        }
    }
}

/// Drops a caught panic's payload without letting it unwind into the loader: the payload
/// is the caller's value, and its `Drop` is the caller's code, which may panic too. That
/// second panic is caught here, and its payload is forgotten rather than dropped (it could
/// panic again, without end): a leak of one box, once per hook.
fn drop_payload(payload: Box<dyn Any + Send>) {
    if let Err(again) = catch_unwind(AssertUnwindSafe(move || drop(payload))) {
        std::mem::forget(again);
    }
}
