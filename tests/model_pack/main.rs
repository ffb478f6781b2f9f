//! `Checkpoint::pack` into a `PinStore`: every fixture written by the official writers
//! (`NUMAPIN_FIXTURES`, made by `cargo xtask fixtures`) packed with `Layout::Interleave`
//! over the allowed nodes, every slot compared with the bytes numpy wrote, the slot map
//! against the pieces, reads counted, dense layers absent, `piece_align` (its own module),
//! `verify`.
#![cfg(feature = "model")]

#[path = "../common/mod.rs"]
mod common;
mod piece_align;

use common::fixtures;

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use numapin::model::{
    Checkpoint, CustomNaming, ExpertPlan, ModelReport, Naming, TensorPiece, TensorRef,
};
use numapin::store::{Kind, Layout, PinStore, StoreOptions};
use numapin::{CheckpointFault, Error};

use numapin::policy::Placement;

const FIXTURES: [&str; 6] = [
    "st-sharded",
    "st-single",
    "st-mixtral",
    "st-fused",
    "gguf-single",
    "gguf-split",
];

fn store(piece_align: usize) -> PinStore {
    let options = StoreOptions::default().piece_align(piece_align);
    PinStore::new(Layout::Interleave(common::nodes()), options).unwrap()
}

fn expected_placement() -> Option<Placement> {
    Some(common::degrade_here().map_or(Placement::Bound, Placement::Degraded))
}

struct Fixture {
    root: PathBuf,
    json: serde_json::Value,
    checkpoint: Checkpoint,
}

impl Fixture {
    fn open(dir: &Path, name: &str) -> Fixture {
        let root = dir.join(name);
        let json: serde_json::Value = serde_json::from_slice(
            &std::fs::read(root.join("fixture.json")).expect("fixture.json"),
        )
        .expect("fixture.json parses");
        let checkpoint = Checkpoint::open(root.join(json["path"].as_str().unwrap())).unwrap();
        Fixture {
            root,
            json,
            checkpoint,
        }
    }

    /// The bytes numpy wrote for a slot (`None`: no such file, a model without scales).
    fn expected(&self, layer: usize, expert: usize, kind: Kind) -> Option<Vec<u8>> {
        let path = self
            .root
            .join("expected")
            .join(format!("L{layer}_E{expert}.{}.bin", kind.name()));
        std::fs::read(path).ok()
    }

    /// Layer → experts, as the generator wrote them.
    fn layers(&self) -> BTreeMap<usize, usize> {
        self.json["layers"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.parse().unwrap(), v.as_u64().unwrap() as usize))
            .collect()
    }

    fn has_scales(&self) -> bool {
        self.json["has_scales"].as_bool().unwrap()
    }

    /// Bytes of every expected slot file.
    fn expected_bytes(&self) -> u64 {
        std::fs::read_dir(self.root.join("expected"))
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .sum()
    }
}

fn read_piece(checkpoint: &Checkpoint, piece: &TensorPiece) -> Vec<u8> {
    let mut buf = vec![0u8; piece.len() as usize];
    checkpoint.files()[piece.file()]
        .file()
        .read_exact_at(&mut buf, piece.offset())
        .unwrap();
    buf
}

/// `pread`s a slot of these pieces needs: runs of pieces that continue each other in one
/// file are one read (with pieces back to back in the slot).
fn runs(pieces: &[TensorPiece]) -> usize {
    let mut count = 0;
    let mut last: Option<&TensorPiece> = None;
    for p in pieces.iter().filter(|p| !p.is_empty()) {
        let continues =
            last.is_some_and(|l| l.file() == p.file() && l.offset() + l.len() == p.offset());
        if !continues {
            count += 1;
        }
        last = Some(p);
    }
    count
}

fn pieces(plan: &ExpertPlan, layer: usize, expert: usize, kind: Kind) -> &[TensorPiece] {
    let e = &plan.layer(layer).unwrap().experts()[expert];
    match kind {
        Kind::Weights => e.weights(),
        Kind::Scales => e.scales(),
    }
}

/// Packs fixture `name` and checks everything a pack promises.
fn pack_fixture(test: &str, name: &str) {
    let Some(dir) = fixtures(test) else { return };
    let f = Fixture::open(&dir, name);
    let store = store(1);
    let report = f.checkpoint.pack(&store).unwrap();
    let plan = f.checkpoint.expert_plan().unwrap();
    let layers = f.layers();
    check_report(&f, &report, &layers);
    check_slots(&f, name, &store, &plan, &report, &layers);
    check_stats_and_absent_layers(&store, &report, &layers);

    // verify re-reads every piece.
    let scale_regions = usize::from(f.has_scales());
    let verified = f.checkpoint.verify(&store).unwrap();
    assert!(verified.verified(), "{verified}");
    assert_eq!(
        verified.slots,
        layers.values().sum::<usize>() * (1 + scale_regions)
    );
    assert_eq!(verified.bytes, report.bytes);

    // A second pack into the same store is refused at the first layer.
    let first = *layers.keys().next().unwrap();
    assert!(matches!(
        f.checkpoint.pack(&store),
        Err(Error::AlreadyPacked { layer, in_progress: false, .. }) if layer == first
    ));
}

/// The report against what the generator wrote.
fn check_report(f: &Fixture, report: &ModelReport, layers: &BTreeMap<usize, usize>) {
    assert_eq!(report.naming, f.json["naming"].as_str().unwrap());
    assert_eq!(report.files as u64, f.json["files"].as_u64().unwrap());
    assert_eq!(report.layers, layers.len());
    assert_eq!(report.experts_per_layer, *layers);
    assert_eq!(
        report.engine_tensors as u64,
        f.json["engine_tensors"].as_u64().unwrap()
    );
    let all_bytes: u64 = f.checkpoint.tensors().iter().map(|t| t.len()).sum();
    assert_eq!(report.bytes, f.expected_bytes());
    assert_eq!(report.engine_bytes, all_bytes - f.expected_bytes());
    assert_eq!(
        report
            .layer_reports
            .iter()
            .map(|r| (r.layer, r.experts))
            .collect::<BTreeMap<_, _>>(),
        *layers
    );
    let scale_regions = usize::from(f.has_scales());
    for r in &report.layer_reports {
        assert_eq!(r.regions, 1 + scale_regions, "{r:?}");
        assert_eq!(r.placement, expected_placement(), "{r:?}");
    }
    assert_eq!(
        report.layer_reports.iter().map(|r| r.bytes).sum::<u64>(),
        report.bytes
    );
    let line = report.to_string();
    assert!(
        line.contains(&format!("naming {}", report.naming)) && line.contains("left for the engine"),
        "{line}"
    );
}

/// Every slot equals numpy's bytes; the slot map agrees with the pieces; reads counted.
fn check_slots(
    f: &Fixture,
    name: &str,
    store: &PinStore,
    plan: &ExpertPlan,
    report: &ModelReport,
    layers: &BTreeMap<usize, usize>,
) {
    let mut reads = 0;
    for (&layer, &experts) in layers {
        let map = store.slot_map(layer).unwrap();
        assert_eq!(map.experts(), experts);
        assert_eq!(map.piece_align(), 1);
        let mut layer_reads = 0;
        for e in 0..experts {
            for kind in Kind::ALL {
                let slot = match kind {
                    Kind::Weights => store.weights(layer, e).unwrap(),
                    Kind::Scales => store.scales(layer, e).unwrap(),
                };
                match f.expected(layer, e, kind) {
                    Some(want) => assert!(slot == want, "{name} layer {layer} expert {e} {kind:?}"),
                    None => {
                        assert_eq!(kind, Kind::Scales);
                        assert!(!f.has_scales());
                        assert!(slot.is_empty());
                    }
                }
                let from_plan = pieces(plan, layer, e, kind);
                let places = map.pieces(e, kind).unwrap();
                assert_eq!(places.len(), from_plan.len());
                let mut at = 0;
                for (place, piece) in places.iter().zip(from_plan) {
                    assert_eq!((place.offset, place.len as u64), (at, piece.len()));
                    assert!(slot[place.offset..place.end()] == read_piece(&f.checkpoint, piece));
                    at = place.end();
                }
                assert_eq!(at, slot.len());
                layer_reads += runs(from_plan);
            }
        }
        let r = report
            .layer_reports
            .iter()
            .find(|r| r.layer == layer)
            .unwrap();
        assert_eq!(r.reads, layer_reads, "layer {layer}");
        reads += layer_reads;
    }
    assert_eq!(report.reads, reads);
}

/// Dense layers (and the one past the last) are absent; the stats count what was packed.
fn check_stats_and_absent_layers(
    store: &PinStore,
    report: &ModelReport,
    layers: &BTreeMap<usize, usize>,
) {
    let last = *layers.keys().next_back().unwrap();
    let dense: Vec<usize> = (0..=last + 1).filter(|l| !layers.contains_key(l)).collect();
    assert!(dense.contains(&(last + 1)));
    for layer in dense {
        assert!(
            matches!(store.weights(layer, 0), Err(Error::NotPacked { layer: l, .. }) if l == layer),
            "layer {layer}"
        );
        assert!(matches!(
            store.slot_map(layer),
            Err(Error::NotPacked { .. })
        ));
    }
    let stats = store.stats().unwrap();
    assert_eq!(stats.layers, layers.len());
    assert_eq!(stats.experts_loaded, layers.values().sum::<usize>());
    assert_eq!(stats.bytes, report.bytes);
}

#[test]
fn pack_sharded_safetensors() {
    pack_fixture("pack_sharded_safetensors", "st-sharded");
}

#[test]
fn pack_single_safetensors() {
    pack_fixture("pack_single_safetensors", "st-single");
}

#[test]
fn pack_mixtral_directory() {
    pack_fixture("pack_mixtral_directory", "st-mixtral");
}

#[test]
fn pack_fused_experts() {
    pack_fixture("pack_fused_experts", "st-fused");
}

#[test]
fn pack_gguf() {
    pack_fixture("pack_gguf", "gguf-single");
}

#[test]
fn pack_gguf_expert_biases() {
    pack_fixture("pack_gguf_expert_biases", "gguf-expert-biases");
}

#[test]
fn pack_deepseek_v3_fp8_fills_both_regions() {
    pack_fixture(
        "pack_deepseek_v3_fp8_fills_both_regions",
        "fam-deepseek-v3-fp8",
    );
}

#[test]
fn pack_gguf_fused_gate_up() {
    pack_fixture("pack_gguf_fused_gate_up", "gguf-fused-gate-up");
}

#[test]
fn pack_every_family_of_the_generic_naming() {
    for name in [
        "fam-qwen35-moe",
        "fam-qwen3-vl-moe",
        "fam-llama4",
        "fam-jamba",
        "fam-lfm2-moe",
        "fam-granite-moe",
        "fam-granite-moe-v5",
        "fam-jetmoe",
        "fam-gpt-oss",
        "fam-gpt-oss-mxfp4",
        "fam-dbrx",
    ] {
        pack_fixture("pack_every_family_of_the_generic_naming", name);
    }
}

#[test]
fn pack_gguf_split() {
    pack_fixture("pack_gguf_split", "gguf-split");
}

/// The sharded fixture's expert whose pieces lie in both shards, packed alone (a custom
/// naming that keeps only its tensors): its slots fill with one read per run of pieces in
/// one file, straight from both shards, and equal numpy's bytes.
#[test]
fn an_expert_straddling_two_shards_reads_each_shard_into_its_slot() {
    let Some(dir) = fixtures("an_expert_straddling_two_shards") else {
        return;
    };
    let f = Fixture::open(&dir, "st-sharded");
    let plan = f.checkpoint.expert_plan().unwrap();
    let (layer, expert) = plan
        .layers()
        .iter()
        .flat_map(|l| {
            l.experts()
                .iter()
                .enumerate()
                .map(move |(e, x)| (l.layer(), e, x))
        })
        .find(|(_, _, x)| {
            let first = x.weights()[0].file();
            x.weights()
                .iter()
                .chain(x.scales())
                .any(|p| p.file() != first)
        })
        .map(|(l, e, _)| (l, e))
        .expect("the sharded fixture has an expert across both shards");
    let files = |kind| {
        let mut f: Vec<usize> = pieces(&plan, layer, expert, kind)
            .iter()
            .map(TensorPiece::file)
            .collect();
        f.dedup();
        f
    };
    let weight_files = files(Kind::Weights);
    assert!(weight_files.len() >= 2, "{weight_files:?}");

    let alone = Naming::Custom(CustomNaming::new("one expert", move |name| {
        let r = Naming::PerExpert.classify(name)?;
        (r.layer == layer && r.expert == Some(expert)).then_some(TensorRef {
            expert: Some(0),
            ..r
        })
    }));
    let store = store(1);
    let report = f.checkpoint.pack_with(&store, &alone).unwrap();
    assert_eq!(report.naming, "one expert");
    assert_eq!(report.experts_per_layer, BTreeMap::from([(layer, 1)]));
    let want_reads = runs(pieces(&plan, layer, expert, Kind::Weights))
        + runs(pieces(&plan, layer, expert, Kind::Scales));
    assert!(want_reads >= 2);
    assert_eq!(report.reads, want_reads);
    assert_eq!(
        store.weights(layer, 0).unwrap(),
        f.expected(layer, expert, Kind::Weights).unwrap()
    );
    assert_eq!(
        store.scales(layer, 0).unwrap(),
        f.expected(layer, expert, Kind::Scales).unwrap()
    );
    let other: usize = f.checkpoint.tensors().len() - report.engine_tensors;
    assert_eq!(
        other,
        pieces(&plan, layer, expert, Kind::Weights).len()
            + pieces(&plan, layer, expert, Kind::Scales).len()
    );
}

fn scratch(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("model_pack")
        .join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A checkpoint whose names no preset knows: `pack` says which names look like experts,
/// and the store stays empty.
#[test]
fn pack_without_recognised_experts_lists_lookalikes() {
    let dir = scratch("no-experts");
    let header = r#"{"layers.0.moe.experts.0.fc1":{"dtype":"F16","shape":[2,2],"data_offsets":[0,8]},"norm":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(&[7u8; 16]);
    std::fs::write(dir.join("m.safetensors"), bytes).unwrap();
    let checkpoint = Checkpoint::open(dir.join("m.safetensors")).unwrap();
    let store = store(1);
    match checkpoint.pack(&store) {
        Err(Error::Checkpoint {
            kind: CheckpointFault::NoExperts,
            reason,
            ..
        }) => {
            assert!(reason.contains("layers.0.moe.experts.0.fc1"), "{reason}");
            assert!(!reason.contains("norm"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(store.stats().unwrap().layers, 0);
}

/// `verify` finds a byte that changed in the file after the pack, in the right slot at
/// the right offset, and nothing else.
#[test]
fn verify_finds_a_byte_changed_after_the_pack() {
    let Some(dir) = fixtures("verify_finds_a_byte_changed_after_the_pack") else {
        return;
    };
    let copy = scratch("verify");
    let source = dir.join("st-single").join("model.safetensors");
    std::fs::copy(&source, copy.join("model.safetensors")).unwrap();
    let checkpoint = Checkpoint::open(copy.join("model.safetensors")).unwrap();
    let store = store(1);
    checkpoint.pack(&store).unwrap();
    assert!(checkpoint.verify(&store).unwrap().verified());

    let plan = checkpoint.expert_plan().unwrap();
    let layer = plan.layers()[1].layer();
    let up = pieces(&plan, layer, 2, Kind::Weights)[1];
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(copy.join("model.safetensors"))
        .unwrap();
    let at = up.offset() + 5;
    let mut byte = [0u8; 1];
    checkpoint.files()[0]
        .file()
        .read_exact_at(&mut byte, at)
        .unwrap();
    file.write_all_at(&[!byte[0]], at).unwrap();

    let report = checkpoint.verify(&store).unwrap();
    assert!(!report.verified());
    assert_eq!(report.mismatched_slots, 1);
    let m = &report.mismatches[0];
    let place = store
        .slot_map(layer)
        .unwrap()
        .pieces(2, Kind::Weights)
        .unwrap()[1];
    assert_eq!(
        (m.layer, m.expert, m.kind, m.slot_offset),
        (layer, 2, Kind::Weights, place.offset + 5)
    );
    assert!(
        report.to_string().starts_with("NOT verified: 1 of"),
        "{report}"
    );
}
