//! Dense tensors laid out for direct reads (`Checkpoint::place` with `ReadMode::Direct`):
//! each tensor starts at an address congruent to its file offset modulo the larger of the
//! file's direct-I/O alignment and 64 (so 64-aligned where its file offset is), so that
//! its read lands in place and only the partial units at its ends go through the bounce
//! buffer. Counted, not timed: the bytes copied out of the bounce buffer with the layout
//! off (`piece_congruence(1)`) and on (the default), on the `gguf-aligned64` fixture
//! (every tensor 64-aligned in the file) and on the others (GGUF's 32-byte alignment and
//! safetensors' 8-byte header leave some tensors off 64: they keep the alignment and
//! bounce). Every tensor's bytes are compared with numpy's either way. Where the files'
//! file system has no direct I/O (the VM's initramfs, tmpfs) the direct path does not
//! run: the test says so and checks that nothing bounced and nothing was padded.
#![cfg(feature = "model")]

mod common;

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use numapin::NodeSet;
use numapin::model::{Checkpoint, DenseLayout, PlacedModel, PlacementPlan, TensorClass};
use numapin::store::{Layout, ReadMode, StoreOptions};

fn fixtures(test: &str) -> Option<PathBuf> {
    match std::env::var_os("NUMAPIN_FIXTURES") {
        Some(dir) => Some(PathBuf::from(dir)),
        None => {
            let _ = writeln!(
                std::io::stderr(),
                "NOT RUN: {test}: set NUMAPIN_FIXTURES (`cargo xtask fixtures`)"
            );
            None
        }
    }
}

fn open(dir: &Path, name: &str) -> Checkpoint {
    let root = dir.join(name);
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(root.join("fixture.json")).unwrap()).unwrap();
    Checkpoint::open(root.join(json["path"].as_str().unwrap())).unwrap()
}

/// numpy's bytes of every tensor, by name.
fn numpy_tensors(root: &Path) -> BTreeMap<String, Vec<u8>> {
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(root.join("tensors.json")).unwrap()).unwrap();
    json.as_array()
        .unwrap()
        .iter()
        .map(|t| {
            let file = root.join("tensors").join(t["file"].as_str().unwrap());
            (
                t["name"].as_str().unwrap().to_owned(),
                std::fs::read(file).unwrap(),
            )
        })
        .collect()
}

fn plan(nodes: NodeSet) -> PlacementPlan {
    PlacementPlan::new(Layout::SplitExperts(nodes), DenseLayout::Replicate(nodes))
}

fn direct() -> StoreOptions {
    StoreOptions::default()
        .loader_threads(2)
        .read_mode(ReadMode::Direct)
}

/// The direct-I/O alignments of `file` as statx reports them: (memory, offset); `None`:
/// no direct I/O there.
fn dio_aligns(file: &File) -> Option<(u64, u64)> {
    let s = rustix::fs::statx(
        file,
        c"",
        rustix::fs::AtFlags::EMPTY_PATH,
        rustix::fs::StatxFlags::DIOALIGN,
    )
    .ok()?;
    let reported = s.stx_mask & rustix::fs::StatxFlags::DIOALIGN.bits() != 0
        && s.stx_dio_mem_align > 0
        && s.stx_dio_offset_align > 0;
    reported.then(|| {
        (
            u64::from(s.stx_dio_mem_align),
            u64::from(s.stx_dio_offset_align),
        )
    })
}

/// What a placement bounced, over the dense classes.
fn dense_bounced(model: &PlacedModel) -> u64 {
    let report = model.report().unwrap();
    report.measured.iter().map(|m| m.bounced_bytes).sum()
}

/// Every tensor (every copy) equal to numpy's, and the whole-model check passes.
fn check_bytes(
    name: &str,
    checkpoint: &Checkpoint,
    model: &PlacedModel,
    numpy: &BTreeMap<String, Vec<u8>>,
) {
    for t in checkpoint.tensors() {
        let view = model.tensor(t.name()).unwrap();
        let Some(held) = view.bytes() else {
            assert_eq!(
                view.class(),
                TensorClass::RoutedExperts,
                "{name} {}",
                t.name()
            );
            continue;
        };
        assert!(
            held == &numpy[t.name()][..],
            "{name} {}: not numpy's bytes",
            t.name()
        );
        for (node, copy) in model.tensor_copies(t.name()).unwrap() {
            assert!(
                copy == &numpy[t.name()][..],
                "{name} {} copy on {node:?}",
                t.name()
            );
        }
    }
    let verify = model.verify(checkpoint).unwrap();
    assert!(verify.verified(), "{name}: {verify}");
}

/// The dense tensors' placement in memory, every copy: (class, layer, copy) → (address,
/// length, file offset), by address.
type Slots = BTreeMap<(TensorClass, Option<usize>, usize), Vec<(usize, usize, u64)>>;

fn dense_slots(checkpoint: &Checkpoint, model: &PlacedModel) -> Slots {
    let mut slots: Slots = BTreeMap::new();
    for t in checkpoint.tensors() {
        let view = model.tensor(t.name()).unwrap();
        if view.class() == TensorClass::RoutedExperts || t.is_empty() {
            continue;
        }
        for (copy, (_, bytes)) in model
            .tensor_copies(t.name())
            .unwrap()
            .into_iter()
            .enumerate()
        {
            slots
                .entry((view.class(), view.layer(), copy))
                .or_default()
                .push((bytes.as_ptr() as usize, bytes.len(), t.offset()));
        }
    }
    for tensors in slots.values_mut() {
        tensors.sort_unstable();
    }
    slots
}

/// Layout (c): every dense tensor (every copy) congruent to its file offset modulo
/// `max(unit, 64)` (64-aligned where its file offset is, since issue 34: a tensor off 64
/// in the file follows its offset and lands in place); less than `max(unit, 64)` bytes of
/// padding before each. And the cost counted before anything was reserved is what the slots
/// take: each group's extent, from the page its first tensor is in to its last byte,
/// rounded to the page, summed per class, is the class's bytes on the first node.
fn check_layout(name: &str, checkpoint: &Checkpoint, model: &PlacedModel, unit: u64) {
    let page = numapin::page_size();
    let mut per_class: BTreeMap<TensorClass, u64> = BTreeMap::new();
    for ((class, layer, copy), tensors) in dense_slots(checkpoint, model) {
        let mut end = tensors[0].0 / page * page;
        for &(address, len, offset) in &tensors {
            let at =
                format!("{name} {class} layer {layer:?} copy {copy}: {address:#x} file {offset}");
            // Congruent to its file offset modulo max(unit, 64), whatever that offset: so
            // 64-aligned where the file offset is, and read in place where it is not.
            let modulus = unit.max(64);
            assert_eq!(
                address as u64 % modulus,
                offset % modulus,
                "{at}: not congruent"
            );
            assert!(
                address >= end && ((address - end) as u64) < modulus,
                "{at}: padding"
            );
            end = address + len;
        }
        if copy == 0 {
            let first = tensors[0].0 / page * page;
            *per_class.entry(class).or_default() += (end - first).next_multiple_of(page) as u64;
        }
    }
    let cost = &model.report().unwrap().cost;
    for (class, bytes) in per_class {
        let c = cost.classes.iter().find(|c| c.class == class).unwrap();
        let on_first = c.node_bytes.values().next().copied().unwrap_or(0);
        assert_eq!(
            on_first, bytes,
            "{name} {class}: the cost is what the slots take"
        );
    }
}

#[test]
fn direct_reads_of_dense_tensors_land_in_place() {
    let test = "direct_reads_of_dense_tensors_land_in_place";
    let Some(dir) = fixtures(test) else {
        return;
    };
    let nodes = common::nodes();
    for name in [
        "gguf-aligned64",
        "gguf-single",
        "gguf-split",
        "st-sharded",
        "fam-deepseek-v3-fp8",
    ] {
        let checkpoint = open(&dir, name);
        let numpy = numpy_tensors(&dir.join(name));
        let aligns = dio_aligns(checkpoint.files()[0].file());
        let before = checkpoint
            .place(&plan(nodes), direct().piece_congruence(1))
            .unwrap();
        check_bytes(name, &checkpoint, &before, &numpy);
        let after = checkpoint.place(&plan(nodes), direct()).unwrap();
        check_bytes(name, &checkpoint, &after, &numpy);
        let expert_modes: Vec<ReadMode> = after
            .report()
            .unwrap()
            .experts
            .iter()
            .flat_map(|r| &r.layer_reports)
            .map(|l| l.read_mode)
            .collect();
        let Some((mem, unit)) =
            aligns.filter(|_| expert_modes.iter().all(|&m| m == ReadMode::Direct))
        else {
            println!(
                "NOT RUN (direct path): {test}: {name}: the fixture's file system reports no \
                 direct-I/O alignment or refused O_DIRECT (read modes {expert_modes:?}): checked \
                 that nothing bounced and nothing was padded"
            );
            assert_eq!(
                (dense_bounced(&before), dense_bounced(&after)),
                (0, 0),
                "{name}"
            );
            assert_eq!(before.report().unwrap().cost, after.report().unwrap().cost);
            continue;
        };
        // The address must follow the file offset modulo the memory alignment: from the
        // first aligned file offset on, the read goes straight in.
        check_layout(name, &checkpoint, &after, mem);
        // The dense pieces, and those at a multiple of 64 in the file (in place).
        let (mut pieces, mut aligned_bytes, mut off_bytes) = (0u64, 0u64, 0u64);
        for tensors in dense_slots(&checkpoint, &after).into_values() {
            for (_, len, offset) in tensors {
                pieces += 1;
                if offset.is_multiple_of(64) {
                    aligned_bytes += len as u64;
                } else {
                    off_bytes += len as u64;
                }
            }
        }
        let (was, now) = (dense_bounced(&before), dense_bounced(&after));
        println!(
            "{name}: direct-I/O alignment: memory {mem}, offset {unit}: dense bytes bounced {was} with the layout off, \
             {now} on ({pieces} dense pieces; {aligned_bytes} bytes at a multiple of 64 in the \
             file, {off_bytes} not)"
        );
        // (a) On: at most the head and the tail of each in-place piece, and whatever is
        // off 64 in the file (kept aligned, so it bounces).
        assert!(
            now <= 2 * unit * pieces + off_bytes,
            "{name}: {now} bounced"
        );
        if name == "gguf-aligned64" {
            assert_eq!(off_bytes, 0, "every tensor 64-aligned in the file");
            // Off: the slot offsets follow no file offset, so nearly every byte bounced.
            let dense = aligned_bytes;
            assert!(
                was * 10 >= dense * 9,
                "{name}: only {was} of {dense} bounced"
            );
            assert!(now * 4 < was, "{name}: {now} not well below {was}");
        }
    }
}

#[test]
fn bad_congruence_moduli_are_refused_before_anything_is_reserved() {
    let test = "bad_congruence_moduli_are_refused_before_anything_is_reserved";
    let Some(dir) = fixtures(test) else {
        return;
    };
    let checkpoint = open(&dir, "gguf-aligned64");
    let nodes = common::nodes();
    let page = numapin::page_size();
    for modulus in [3, 100, usize::MAX, numapin::store::MAX_ALIGN * 2, page * 2] {
        for mode in [ReadMode::Direct, ReadMode::Buffered] {
            let options = direct().read_mode(mode).piece_congruence(modulus);
            let e = checkpoint
                .placement_cost(&plan(nodes), &options)
                .unwrap_err();
            assert!(e.to_string().contains("piece_congruence"), "{modulus}: {e}");
            let e = checkpoint.place(&plan(nodes), options).unwrap_err();
            assert!(e.to_string().contains("piece_congruence"), "{modulus}: {e}");
        }
    }
    // A modulus the caller gives is used in every read mode; the dry run prices it as
    // placing lays it out.
    let options = StoreOptions::default()
        .loader_threads(2)
        .piece_congruence(page);
    let model = checkpoint.place(&plan(nodes), options.clone()).unwrap();
    assert_eq!(
        model.report().unwrap().cost,
        checkpoint.placement_cost(&plan(nodes), &options).unwrap()
    );
    check_layout("gguf-aligned64 buffered", &checkpoint, &model, page as u64);
    let numpy = numpy_tensors(&dir.join("gguf-aligned64"));
    check_bytes("gguf-aligned64 buffered", &checkpoint, &model, &numpy);
}

/// A checkpoint on tmpfs (no `O_DIRECT` there): a direct placement falls back to buffered
/// reads, says so per file, lays nothing out for direct reads (the cost is the layout's
/// with the congruence off), bounces nothing, and holds numpy's bytes.
#[test]
fn a_direct_placement_on_tmpfs_falls_back_and_pads_nothing() {
    let test = "a_direct_placement_on_tmpfs_falls_back_and_pads_nothing";
    let Some(dir) = fixtures(test) else {
        return;
    };
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() {
        println!("NOT RUN: {test}: no /dev/shm");
        return;
    }
    let name = "st-sharded";
    let copy = shm.join(format!("numapin-dio-tmpfs-{}", std::process::id()));
    let source = dir.join(name);
    std::fs::create_dir_all(copy.join("model")).unwrap();
    std::fs::copy(source.join("fixture.json"), copy.join("fixture.json")).unwrap();
    for entry in std::fs::read_dir(source.join("model")).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, copy.join("model").join(path.file_name().unwrap())).unwrap();
    }
    let checkpoint = Checkpoint::open(copy.join("model")).unwrap();
    if dio_aligns(checkpoint.files()[0].file()).is_some() {
        println!("NOT RUN: {test}: /dev/shm reports a direct-I/O alignment here");
        std::fs::remove_dir_all(&copy).unwrap();
        return;
    }
    let numpy = numpy_tensors(&source);
    let nodes = common::nodes();
    let off = checkpoint
        .place(&plan(nodes), direct().piece_congruence(1))
        .unwrap();
    let placed = checkpoint.place(&plan(nodes), direct()).unwrap();
    check_bytes(name, &checkpoint, &placed, &numpy);
    let report = placed.report().unwrap();
    assert_eq!(
        report.cost,
        off.report().unwrap().cost,
        "padded for direct reads"
    );
    assert_eq!(dense_bounced(&placed), 0);
    for m in &report.measured {
        assert_eq!(m.direct_reads.in_place_bytes, 0, "{}", m.class);
        for f in &m.files {
            assert_eq!(f.mode, ReadMode::Buffered, "{}: {f}", m.class);
            assert!(f.fallback.is_some(), "{}: {f}: no reason", m.class);
        }
    }
    for l in report.experts.iter().flat_map(|r| &r.layer_reports) {
        assert_eq!((l.read_mode, l.bounced_bytes), (ReadMode::Buffered, 0));
        assert!(l.read_fallback.is_some(), "layer {}: no reason", l.layer);
    }
    std::fs::remove_dir_all(&copy).unwrap();
}
