//! Hostile inputs: sizes, indices and counts at the edge of `usize`, node contexts and node
//! strings built to hang, and a map table filled to the last slot. Each must end in a
//! value or an error: never a panic, an abort or a hang.
//!
//! Where the old failure was an abort (the map-limit cases), the test runs its body in a
//! child process (this binary again, selected by `NUMAPIN_HOSTILE_ROLE`) and asserts on
//! the exit status and the output.

mod common;

use std::process::Command;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use numapin::store::{ExpertSource, LayerSpec, Layout, PinStore, StoreOptions};
use numapin::{
    Advice, Errno, Error, KernelMask, MAX_NODES, NodeContext, NodeSet, Region, diag, page_size,
};

use numapin::policy::Observed;

const ROLE: &str = "NUMAPIN_HOSTILE_ROLE";

/// Runs `test` (this binary's test of that name) again in a child process with the role
/// set; returns its stdout after checking that it exited successfully.
fn run_child(test: &str, extra_env: &[(&str, String)]) -> String {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(ROLE, test);
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "child {test} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn is_child(test: &str) -> bool {
    std::env::var(ROLE).is_ok_and(|r| r == test)
}

/// What a freshly spawned thread adds to this process's map table while it runs (after
/// its first allocation), and what a second one adds once the first has exited.
#[test]
fn loader_thread_map_cost() {
    const NAME: &str = "loader_thread_map_cost";
    if is_child(NAME) {
        let measure = || {
            let before = diag::map_count().unwrap();
            let (tx, rx) = std::sync::mpsc::channel::<usize>();
            let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
            let t = std::thread::spawn(move || {
                drop(std::hint::black_box(Box::new(1u8)));
                tx.send(diag::map_count().unwrap()).unwrap();
                done_rx.recv().unwrap();
            });
            let during = rx.recv().unwrap();
            done_tx.send(()).unwrap();
            t.join().unwrap();
            let after = diag::map_count().unwrap();
            (during - before, after as isize - before as isize)
        };
        let first = measure();
        let second = measure();
        println!(
            "THREAD first_running={} first_after={} second_running={} second_after={}",
            first.0, first.1, second.0, second.1
        );
        return;
    }
    let out = run_child(NAME, &[]);
    let line = report(&out, "THREAD");
    let first = field(line, "first_running=");
    let second = field(line, "second_running=");
    // The budget's figure is the fresh thread's, and it must not undercount.
    assert!(
        first <= numapin::store::LOADER_THREAD_MAPS,
        "a fresh thread adds {first} mappings, the budget counts {}: {line}",
        numapin::store::LOADER_THREAD_MAPS
    );
    assert!(second <= first, "{line}");
}

fn report<'a>(out: &'a str, tag: &str) -> &'a str {
    out.lines()
        .find_map(|l| l.find(tag).map(|at| &l[at..]))
        .unwrap_or_else(|| panic!("no {tag} line in:\n{out}"))
}

fn field(line: &str, key: &str) -> usize {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.parse().ok())
        .unwrap_or_else(|| panic!("{key} missing in {line}"))
}

/// Runs `f` on a thread of its own and fails if it has not returned within a minute: a
/// hang detector, not a measure of speed (the work takes milliseconds).
fn without_hanging<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(60))
        .expect("hung (or panicked) for a minute")
}

// ---- 1. Region::placement_sampled with a huge step ----

#[test]
fn placement_sampled_with_huge_steps_samples_the_first_page() {
    let pages = 4;
    // Fenced: numa_maps (where move_pages is denied) must see this mapping alone.
    let mut region = Region::anonymous_fenced(pages * page_size()).unwrap();
    region.advise(Advice::NoHugePage).unwrap();
    region.as_mut_slice().unwrap()[0] = 1;
    // usize::MAX, its half, and a step whose stride wraps to exactly 0 (a division by
    // zero before).
    let wraps_to_zero = 1usize << (usize::BITS - page_size().trailing_zeros());
    for step in [usize::MAX, usize::MAX / 2, wraps_to_zero, pages, pages + 1] {
        match region.placement_sampled(step).unwrap() {
            Observed::Known(h) if h.source == numapin::PagesSource::NumaMaps => {
                // numa_maps counts are whole whatever the step (one read of the file).
                assert_eq!(h.present(), 1, "step {step}: {h:?}");
                assert_eq!(h.not_present, pages - 1, "step {step}: {h:?}");
            }
            Observed::Known(h) => {
                assert_eq!(h.present(), 1, "step {step}: {h:?}");
                assert_eq!(h.not_present + h.other, 0, "step {step}: {h:?}");
            }
            Observed::Degraded(reason) => {
                assert_eq!(Some(reason), common::degrade_here(), "step {step}")
            }
        }
    }
    // Step 0 is taken as 1: every page.
    match (
        region.placement_sampled(0).unwrap(),
        region.placement().unwrap(),
    ) {
        (Observed::Known(zero), Observed::Known(all)) => {
            assert_eq!(zero, all);
            assert_eq!(zero.present() + zero.not_present, pages);
        }
        (Observed::Degraded(a), Observed::Degraded(b)) => {
            assert_eq!(
                (Some(a), Some(b)),
                (common::degrade_here(), common::degrade_here())
            )
        }
        other => panic!("{other:?}"),
    }
}

// ---- 2. numapin::resident_pages with a huge length ----

#[test]
fn resident_pages_rejects_overflowing_lengths_without_allocating() {
    let region = Region::anonymous(page_size()).unwrap();
    let addr = region.as_ptr() as usize;
    for len in [usize::MAX, usize::MAX - addr + 1, usize::MAX - addr] {
        let e = numapin::resident_pages(addr, len).unwrap_err();
        assert_eq!(e.errno(), Some(Errno::INVAL), "len {len}: {e}");
    }
    // Does not overflow but runs off the mapping: the kernel's ENOMEM, in bounded memory.
    let e = numapin::resident_pages(addr, usize::MAX / 2).unwrap_err();
    assert_eq!(e.errno(), Some(Errno::NOMEM), "{e}");
    assert_eq!(numapin::resident_pages(addr, 0).unwrap(), 0);
}

#[test]
fn resident_pages_counts_exactly_across_windows() {
    // More pages than one mincore window (4096), touched in a pattern that crosses it.
    let pages = 3 * 4096 + 5;
    let mut region = Region::anonymous(pages * page_size()).unwrap();
    region.advise(Advice::NoHugePage).unwrap();
    let slice = region.as_mut_slice().unwrap();
    let touched: Vec<usize> = (0..pages)
        .filter(|p| p % 3 == 0 || *p >= pages - 7)
        .collect();
    for &p in &touched {
        slice[p * page_size()] = 1;
    }
    let addr = region.as_ptr() as usize;
    let len = pages * page_size();
    assert_eq!(numapin::resident_pages(addr, len).unwrap(), touched.len());
    // A length short of a page still counts its page.
    assert_eq!(numapin::resident_pages(addr, 1).unwrap(), 1);
    // Unaligned start: EINVAL, as before.
    let e = numapin::resident_pages(addr + 1, 10).unwrap_err();
    assert_eq!(e.errno(), Some(Errno::INVAL), "{e}");
}

// ---- 3. check_model_budget with counts near usize::MAX ----

fn small_store() -> PinStore {
    PinStore::new(
        Layout::Unplaced,
        StoreOptions::default().huge_pages(false).loader_threads(1),
    )
    .unwrap()
}

#[test]
fn model_budget_with_huge_counts_is_an_error_naming_them() {
    let store = small_store();
    let spec = |experts| LayerSpec {
        experts,
        weight_bytes: 4096,
        scale_bytes: 4096,
    };
    for layers in [usize::MAX, usize::MAX / 2 + 1] {
        let e = store.check_model_budget(layers, &spec(2)).unwrap_err();
        assert!(!matches!(e, Error::MapBudget { .. }), "{e}");
        assert!(e.to_string().contains(&layers.to_string()), "{e}");
    }
    // Fits in usize but not in the map table: MapBudget, not a wrapped Ok.
    let layers = usize::MAX / 4;
    match store.check_model_budget(layers, &spec(2)) {
        Err(Error::MapBudget { needed, .. }) => assert!(needed >= 2 * layers),
        other => panic!("{other:?}"),
    }
    let no_scales = LayerSpec {
        scale_bytes: 0,
        ..spec(2)
    };
    match store.check_model_budget(usize::MAX, &no_scales) {
        Err(e) => assert!(e.to_string().contains(&usize::MAX.to_string()), "{e}"),
        Ok(()) => panic!("usize::MAX layers fit"),
    }
    // The expert count costs no mappings (one region per layer and kind, whatever the
    // count): a huge one is no overflow and no refusal.
    store.check_model_budget(1, &spec(usize::MAX)).unwrap();
}

// ---- 5. NodeContext cannot be made invalid ----

#[test]
fn node_contexts_are_clamped() {
    let allowed = NodeSet::from_nodes([0]).unwrap();
    let zero = NodeContext::new(0, allowed);
    assert_eq!(zero.possible(), 1);
    assert_eq!(NodeSet::parse_in("0", &zero).unwrap(), allowed);
    assert!(NodeSet::parse_in("1", &zero).is_err());
    let huge = NodeContext::new(usize::MAX, allowed);
    assert_eq!(huge.possible(), MAX_NODES);
    assert_eq!(huge.allowed(), allowed);
    let e = NodeSet::parse_in(&MAX_NODES.to_string(), &huge).unwrap_err();
    assert!(matches!(e, Error::Parse { .. }), "{e}");
    let e =
        without_hanging(move || NodeSet::parse_in("0-18446744073709551614", &huge)).unwrap_err();
    assert!(
        matches!(&e, Error::Parse { part, .. } if part == "0-18446744073709551614"),
        "{e}"
    );
    // The whole range of ids parses, word by word.
    let all = without_hanging(move || NodeSet::parse_in("0-1023", &huge)).unwrap();
    assert_eq!(all.len(), MAX_NODES);
}

// ---- 6. Large relative node strings ----

#[test]
fn large_relative_node_strings_parse() {
    let everything = NodeSet::from_nodes(0..MAX_NODES).unwrap();
    let evens = NodeSet::from_nodes((0..MAX_NODES).step_by(2)).unwrap();
    // `+` prefixes the whole list (numactl's syntax): 28 KB of ranges after it.
    let input = format!("+{}", "0-1023,".repeat(28 * 1024 / 7));
    let input = input.trim_end_matches(',').to_string();
    assert!(input.len() >= 28 * 1024 - 1);
    let (all, half, odd_ranks) = without_hanging(move || {
        let ctx = NodeContext::new(MAX_NODES, everything);
        let sparse = NodeContext::new(MAX_NODES, evens);
        let half = format!("+{}", "0-511,".repeat(4096));
        let odd_ranks = format!("!+{}", "1-1,3,5-5,".repeat(2048));
        // `.ok()`: an error would quote the whole 28 KB input.
        (
            NodeSet::parse_in(&input, &ctx).ok(),
            NodeSet::parse_in(half.trim_end_matches(','), &sparse).ok(),
            NodeSet::parse_in(odd_ranks.trim_end_matches(','), &sparse).ok(),
        )
    });
    assert_eq!(all, Some(everything));
    assert_eq!(half, Some(evens));
    // Ranks 1, 3, 5 of the even nodes are nodes 2, 6, 10.
    let mut expected = evens;
    for n in [2, 6, 10] {
        expected.remove(numapin::Node(n));
    }
    assert_eq!(odd_ranks, Some(expected));
}

// ---- Same class elsewhere ----

#[test]
fn other_sizes_indices_and_counts_at_the_edge() {
    let set = NodeSet::from_nodes([0, 5]).unwrap();
    assert_eq!(set.nth(usize::MAX), None);
    assert!(NodeSet::from_nodes([usize::MAX]).is_err());
    let mask = KernelMask::new(&set, usize::MAX);
    assert_eq!(mask.words().len(), MAX_NODES / 64 + 1);
    assert_eq!(NodeSet::from_kernel_words(mask.words()), set);

    assert!(Region::anonymous(usize::MAX).is_err());
    assert!(Region::anonymous(usize::MAX - page_size() + 2).is_err());
    assert!(Region::anonymous_aligned(usize::MAX, 2 << 20).is_err());
    assert!(Region::anonymous_aligned(usize::MAX / 2, 1 << (usize::BITS - 1)).is_err());
    assert!(Region::memfd("hostile", usize::MAX).is_err());
    let mut region = Region::anonymous(page_size()).unwrap();
    for range in [
        0..usize::MAX,
        usize::MAX - 1..usize::MAX,
        page_size()..usize::MAX,
    ] {
        assert!(region.release(range.clone()).is_err(), "{range:?}");
    }
    #[allow(clippy::reversed_empty_ranges)]
    let reversed = usize::MAX..0;
    assert!(region.release(reversed).is_err());
    assert!(region.policy_at(usize::MAX).is_err());

    let store = small_store();
    let data = vec![1u8; 16];
    let source = [ExpertSource::Memory {
        weights: &data,
        scales: &[],
    }];
    for (weight_bytes, scale_bytes) in [(usize::MAX, 0), (16, usize::MAX), (usize::MAX, usize::MAX)]
    {
        let spec = LayerSpec {
            experts: 1,
            weight_bytes,
            scale_bytes,
        };
        assert!(store.pack_layer(0, &spec, &source).is_err(), "{spec:?}");
    }
    assert!(
        store
            .pack_layer(
                usize::MAX,
                &LayerSpec {
                    experts: 1,
                    weight_bytes: 16,
                    scale_bytes: 0
                },
                &source
            )
            .is_err()
    );
    let spec = LayerSpec {
        experts: 1,
        weight_bytes: 16,
        scale_bytes: 0,
    };
    store.pack_layer(0, &spec, &source).unwrap();
    assert!(store.weights(usize::MAX, 0).is_err());
    assert!(store.weights(0, usize::MAX).is_err());
    assert!(store.scales(usize::MAX, usize::MAX).is_err());
    assert_eq!(store.weights(0, 0).unwrap(), &data[..]);
}

// ---- 4. The map budget against loader threads, at the real limit ----

/// Throwaway one-page mappings that hold map slots: alternating protections, so that
/// neighbours never merge.
struct Fillers(Vec<usize>);

impl Fillers {
    /// Maps or unmaps fillers until exactly `free` map slots are left under
    /// `vm.max_map_count`.
    fn leave_free(free: usize) -> Fillers {
        let limit = diag::max_map_count().unwrap();
        let mut fillers = Fillers(Vec::with_capacity(limit));
        for _ in 0..64 {
            let left = limit - diag::map_count().unwrap();
            if left == free {
                return fillers;
            }
            if left > free {
                for _ in 0..left - free {
                    let prot = if fillers.0.len().is_multiple_of(2) {
                        rustix::mm::ProtFlags::empty()
                    } else {
                        rustix::mm::ProtFlags::READ
                    };
                    // SAFETY: a fresh mapping at an address of the kernel's choice.
                    let page = unsafe {
                        rustix::mm::mmap_anonymous(
                            std::ptr::null_mut(),
                            page_size(),
                            prot,
                            rustix::mm::MapFlags::PRIVATE,
                        )
                    }
                    .unwrap();
                    fillers.0.push(page as usize);
                }
            } else {
                for _ in 0..free - left {
                    let page = fillers.0.pop().expect("not enough fillers to unmap");
                    // SAFETY: a filler this struct mapped and nothing references.
                    unsafe { rustix::mm::munmap(page as *mut _, page_size()) }.unwrap();
                }
            }
        }
        panic!("could not leave exactly {free} map slots free");
    }
}

fn outcome(result: &numapin::Result<numapin::store::LayerReport>) -> &'static str {
    match result {
        Ok(_) => "ok",
        Err(Error::MapBudget { .. }) => "mapbudget",
        Err(_) => "error",
    }
}

fn loader_store() -> PinStore {
    PinStore::new(
        Layout::Interleave(NodeSet::allowed().unwrap()),
        StoreOptions::default()
            .huge_pages(false)
            // One helper beside the caller, as on a two-core host by default.
            .loader_threads(2),
    )
    .unwrap()
}

const EXPERTS: usize = 16;

/// Free map slots from none to more than a pack with all its helpers needs: every
/// count ends in Ok or MapBudget, and with plenty free in Ok. (One pack alone did not
/// abort on this host before the fix; this sweep guards the edge the concurrent test
/// below crosses.)
#[test]
fn pack_layer_at_every_headroom_near_the_limit() {
    const NAME: &str = "pack_layer_at_every_headroom_near_the_limit";
    if is_child(NAME) {
        let free: usize = std::env::var("NUMAPIN_HOSTILE_FREE")
            .unwrap()
            .parse()
            .unwrap();
        let store = loader_store();
        let data = vec![7u8; 4096];
        let sources: Vec<ExpertSource> = (0..EXPERTS)
            .map(|_| ExpertSource::Memory {
                weights: &data,
                scales: &data,
            })
            .collect();
        let spec = LayerSpec {
            experts: EXPERTS,
            weight_bytes: 4096,
            scale_bytes: 4096,
        };
        let _fillers = Fillers::leave_free(free);
        let result = store.pack_layer(0, &spec, &sources);
        let loaded = result.is_ok() && store.weights(0, EXPERTS - 1).unwrap() == &data[..];
        println!(
            "PACK free={free} outcome={} loaded={loaded} {result:?}",
            outcome(&result)
        );
        return;
    }
    // Enough for two regions, three fresh helpers and the margins, and then some.
    let plenty = 2 + 3 * numapin::store::LOADER_THREAD_MAPS + 6;
    let mut outcomes = Vec::new();
    for free in 0..=plenty {
        let out = run_child(NAME, &[("NUMAPIN_HOSTILE_FREE", free.to_string())]);
        let line = report(&out, "PACK").to_string();
        assert!(
            line.contains("outcome=ok loaded=true") || line.contains("outcome=mapbudget"),
            "{line}"
        );
        outcomes.push(line.contains("outcome=ok"));
    }
    assert!(outcomes[plenty], "refused with {plenty} map slots free");
    assert!(!outcomes[0], "packed with no map slot free");
    // Once it fits, more room never makes it refuse.
    let first_ok = outcomes.iter().position(|&ok| ok).unwrap();
    assert!(outcomes[first_ok..].iter().all(|&ok| ok), "{outcomes:?}");
}

/// Three packs started at once on one store with 0 to 20 map slots free (8 among them):
/// each ends in Ok or MapBudget. Before the fix each checked alone: with 6 free the
/// process aborted (SIGABRT), with 8 one pack failed with mmap's ENOMEM.
#[test]
fn three_concurrent_packs_near_the_limit() {
    const NAME: &str = "three_concurrent_packs_near_the_limit";
    if is_child(NAME) {
        let free: usize = std::env::var("NUMAPIN_HOSTILE_FREE")
            .unwrap()
            .parse()
            .unwrap();
        let store = Arc::new(loader_store());
        let data = Arc::new(vec![9u8; 4096]);
        let ready = Arc::new(Barrier::new(4));
        let start = Arc::new(Barrier::new(4));
        // The packing threads exist (and have allocated) before the map table fills.
        let threads: Vec<_> = (0..3)
            .map(|layer| {
                let (store, data) = (store.clone(), data.clone());
                let (ready, start) = (ready.clone(), start.clone());
                std::thread::spawn(move || {
                    let sources: Vec<ExpertSource> = (0..EXPERTS)
                        .map(|_| ExpertSource::Memory {
                            weights: &data,
                            scales: &data,
                        })
                        .collect();
                    let spec = LayerSpec {
                        experts: EXPERTS,
                        weight_bytes: 4096,
                        scale_bytes: 4096,
                    };
                    ready.wait();
                    start.wait();
                    let result = store.pack_layer(layer, &spec, &sources);
                    let loaded =
                        result.is_ok() && store.weights(layer, EXPERTS - 1).unwrap() == &data[..];
                    format!("outcome={} loaded={loaded}", outcome(&result))
                })
            })
            .collect();
        ready.wait();
        let _fillers = Fillers::leave_free(free);
        start.wait();
        for (layer, t) in threads.into_iter().enumerate() {
            println!("CONCURRENT layer={layer} {}", t.join().unwrap());
        }
        return;
    }
    for free in 0..=20 {
        let out = run_child(NAME, &[("NUMAPIN_HOSTILE_FREE", free.to_string())]);
        let lines: Vec<&str> = out.lines().filter(|l| l.contains("CONCURRENT")).collect();
        assert_eq!(lines.len(), 3, "{out}");
        for line in lines {
            assert!(
                line.contains("outcome=ok loaded=true") || line.contains("outcome=mapbudget"),
                "free {free}: {line}"
            );
        }
    }
}
