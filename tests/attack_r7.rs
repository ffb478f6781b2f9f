//! Round 7's hostile review of the conversion at placement, role-major slots and the
//! served manifest: each test was written to fail first against the merged tree (or to
//! show an attack that held), and compares with an independent reference (the bits a
//! numpy 2.4.6 `astype(float32)` gives, the file's bytes).
#![cfg(feature = "model")]

mod common;

use numapin::model::{
    Checkpoint, DenseLayout, Dtype, ModelManifest, PlacedModel, PlacementPlan, SafetensorsDtype,
};
use numapin::store::{Layout, StoreOptions};
use numapin::{Error, Invalid};

const F32: Dtype = Dtype::Safetensors(SafetensorsDtype::F32);

fn dir(test: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("numapin-attack7-{}-{test}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A safetensors file of `(name, dtype, shape, bytes)`; returns its path.
fn write(test: &str, tensors: &[(&str, &str, Vec<u64>, Vec<u8>)]) -> std::path::PathBuf {
    let path = dir(test).join("model.safetensors");
    std::fs::write(&path, common::safetensors_bytes(tensors)).unwrap();
    path
}

fn base() -> PlacementPlan {
    PlacementPlan::new(Layout::Unplaced, DenseLayout::Unplaced)
}

/// F16 NaNs (a signalling one, a negative quiet one, one with a payload), infinities
/// and the largest subnormal, and the F32 bits numpy 2.4.6 gives for each
/// (`np.frombuffer(b, np.float16).astype(np.float32).view(np.uint32)`).
const F16_SPECIAL: [(u16, u32); 6] = [
    (0x7c01, 0x7f80_2000),
    (0xfe01, 0xffc0_2000),
    (0x7d55, 0x7faa_a000),
    (0xfc00, 0xff80_0000),
    (0x03ff, 0x387f_c000),
    (0x8001, 0xb380_0000),
];

/// Held: F16 NaN payloads, infinities and subnormals convert to numpy's bits.
#[test]
fn f16_nans_and_infinities_convert_as_numpy_does() {
    let bytes: Vec<u8> = F16_SPECIAL
        .iter()
        .flat_map(|(h, _)| h.to_le_bytes())
        .collect();
    let path = write("f16", &[("model.norm.weight", "F16", vec![6], bytes)]);
    let checkpoint = Checkpoint::open(&path).unwrap();
    let plan = base().convert_pattern("model.norm.weight", F32);
    let model = checkpoint.place(&plan, StoreOptions::default()).unwrap();
    let view = model.tensor("model.norm.weight").unwrap();
    let want: Vec<u8> = F16_SPECIAL
        .iter()
        .flat_map(|(_, f)| f.to_le_bytes())
        .collect();
    assert_eq!(view.bytes().unwrap(), &want[..]);
    assert!(model.verify(&checkpoint).unwrap().verified());
}

/// Held: a converted tensor's file bytes changed after placement are a mismatch.
#[test]
fn a_converted_tensor_changed_in_the_file_is_a_mismatch() {
    let path = write(
        "changed",
        &[("model.norm.weight", "BF16", vec![3], vec![1, 2, 3, 4, 5, 6])],
    );
    let checkpoint = Checkpoint::open(&path).unwrap();
    let plan = base().convert_pattern("model.norm.weight", F32);
    let model = checkpoint.place(&plan, StoreOptions::default()).unwrap();
    let mut file = std::fs::read(&path).unwrap();
    let last = file.len() - 1;
    file[last] ^= 0x40;
    std::fs::write(&path, &file).unwrap();
    let check = model.verify(&checkpoint).unwrap();
    assert!(!check.verified(), "{check:?}");
}

/// `StoreOptions::role_major` above 1 made every dense pack fail deep inside
/// `PinStore::pack_layer` ("role-major slots come in 2 runs of the experts") after the
/// stores were reserved, and a placement of experts alone, their count a multiple of the
/// roles, was taken as role-major (expert `k` given expert `k % (E/R)`'s node). Now a
/// whole placement takes `role_major(R)` only with `R` the experts' weight roles (one
/// slot per role and expert, tests/whole_model/role_major.rs; dense stores stay a slot
/// per group): any other count, and 0, is refused by name before anything is reserved.
#[test]
fn a_whole_placement_refuses_role_major_by_name() {
    // With dense bytes (64), and of experts alone (an empty embedding).
    for embed in [0, 64] {
        let path =
            common::moe_safetensors(&dir(&format!("roles{embed}")), embed, &[0], 4, (4096, 64));
        let checkpoint = Checkpoint::open(&path).unwrap();
        let options = StoreOptions::default();
        assert!(checkpoint.place(&base(), options.clone()).is_ok());
        for roles in [2, 4, 0, usize::MAX] {
            match checkpoint.place(&base(), options.clone().role_major(roles)) {
                Err(Error::InvalidArgument {
                    op: "Checkpoint::place",
                    reason: reason @ Invalid::BadValue { .. },
                }) => assert!(reason.to_string().contains("role_major"), "{reason}"),
                Err(e) => panic!("embed {embed}, role_major({roles}): {e}"),
                Ok(_) => panic!("embed {embed}, role_major({roles}) placed"),
            }
        }
    }
}

/// An attached manifest's `converted_from` was taken as it came: a conversion this
/// crate cannot make (I8 → F32, F32 → F32, a GGML dtype to a safetensors one, BF16 →
/// I8) was attached, and verify then converted the file's bytes as if they were BF16:
/// a view labelled I8 handing out F32 bits verified clean.
#[test]
fn an_attach_refuses_a_conversion_the_crate_cannot_make() {
    let bytes: Vec<u8> = (0..16).collect();
    let path = write(
        "attach",
        &[("model.layers.0.mlp.gate.weight", "BF16", vec![2, 4], bytes)],
    );
    let checkpoint = Checkpoint::open(&path).unwrap();
    let plan = base().convert_pattern("*.gate.weight", F32);
    let mut placed = checkpoint
        .place(&plan, StoreOptions::default().shared(true))
        .unwrap();
    let export = placed.export().unwrap();
    let text = String::from_utf8(export.manifest.to_bytes()).unwrap();
    let clone = || -> Vec<std::fs::File> {
        (export.files.iter())
            .map(|f| f.try_clone().unwrap())
            .collect()
    };
    // The genuine manifest attaches and verifies.
    let manifest = ModelManifest::parse(text.as_bytes()).unwrap();
    let attached = PlacedModel::attach(&manifest, clone()).unwrap();
    assert!(attached.verify(&checkpoint).unwrap().verified());
    let genuine = r#""dtype":"st:F32""#;
    let from = r#""converted_from":"st:BF16""#;
    assert!(text.contains(genuine) && text.contains(from), "{text}");
    for (dtype, converted_from) in [
        ("st:F32", "st:I8"),
        ("st:F32", "st:F32"),
        ("st:F32", "ggml:BF16"),
        ("st:I8", "st:BF16"),
        ("st:BF16", "st:BF16"),
    ] {
        let forged = text
            .replace(genuine, &format!(r#""dtype":"{dtype}""#))
            .replace(from, &format!(r#""converted_from":"{converted_from}""#));
        let manifest = ModelManifest::parse(forged.as_bytes()).unwrap();
        match PlacedModel::attach(&manifest, clone()) {
            Err(Error::InvalidArgument { op, reason }) => {
                assert_eq!(op, "PlacedModel::attach");
                assert!(reason.to_string().contains("conversion"), "{reason}");
            }
            Err(e) => panic!("{converted_from} -> {dtype}: {e}"),
            Ok(_) => panic!("{converted_from} -> {dtype} attached"),
        }
    }
}

/// A file truncated (from another thread) at varied moments while a placement with a
/// converted tensor reads it, in each read mode: the placement fails, or every view
/// holds the file's original bytes (converted where asked); never zeros or a panic.
/// Before the fix, Buffered and Auto placements returned Ok with the plain tensor's
/// bytes from the cut to the next 1 MiB of the file zero: a `pread` that raced the
/// truncation on ext4 was handed the zeroed tail of the large folio it cut, in full.
#[test]
fn a_file_truncated_during_a_placement_is_an_error_or_the_file_bytes() {
    use numapin::store::ReadMode;
    const MIB: usize = 1 << 20;
    let bf16: Vec<u8> = (0..MIB).map(|i| (i % 251) as u8 | 1).collect();
    let plain: Vec<u8> = (0..2 * MIB).map(|i| (i % 253) as u8 | 1).collect();
    let tensors = [
        (
            "model.layers.0.mlp.gate.weight",
            "BF16",
            vec![(MIB / 2) as u64],
            bf16.clone(),
        ),
        (
            "model.layers.0.self_attn.q_proj.weight",
            "U8",
            vec![(2 * MIB) as u64],
            plain.clone(),
        ),
    ];
    let converted: Vec<u8> = bf16
        .chunks_exact(2)
        .flat_map(|b| (u32::from(u16::from_le_bytes([b[0], b[1]])) << 16).to_le_bytes())
        .collect();
    let plan = base().convert_pattern("*.gate.weight", F32);
    let (mut placed, mut refused) = (0, 0);
    for mode in [ReadMode::DropBehind, ReadMode::Buffered, ReadMode::Auto] {
        for delay in [0u64, 500, 5_000] {
            let path = write("truncated", &tensors);
            let checkpoint = Checkpoint::open(&path).unwrap();
            let cut = std::fs::metadata(&path).unwrap().len() / 2;
            let truncate = {
                let path = path.clone();
                std::thread::spawn(move || {
                    std::thread::sleep(std::time::Duration::from_micros(delay));
                    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
                    file.set_len(cut).unwrap();
                })
            };
            let options = StoreOptions::default().read_mode(mode).loader_threads(2);
            let result = checkpoint.place(&plan, options);
            truncate.join().unwrap();
            let Ok(model) = result else {
                refused += 1;
                continue;
            };
            placed += 1;
            let gate = model.tensor(tensors[0].0).unwrap();
            let held = gate.bytes().unwrap();
            let at = held.iter().zip(&converted).position(|(a, b)| a != b);
            assert!(
                held == &converted[..],
                "{mode:?} {delay}: gate differs at {at:?}"
            );
            let q = model.tensor(tensors[1].0).unwrap();
            let held = q.bytes().unwrap();
            let at = held.iter().zip(&plain).position(|(a, b)| a != b);
            assert!(
                held == &plain[..],
                "{mode:?} {delay}: {} bytes, first difference at {at:?}: {:?}",
                held.len(),
                at.map(|i| (
                    held[i],
                    plain[i],
                    held[i..].iter().filter(|&&b| b == 0).count()
                ))
            );
            // The file is now cut: verify fails or says so, never passes.
            if let Ok(check) = model.verify(&checkpoint) {
                assert!(!check.verified(), "{mode:?} {delay}: {check:?}");
            }
        }
    }
    eprintln!("placed {placed}, refused {refused}");
}

/// `check_model_budget` of a layer of 0 experts in a split store with role-major slots:
/// `0` is a multiple of any role count, so the layer was taken as `roles` runs of 0
/// experts and the arithmetic walked every run (`usize::MAX` of them: a hang). It must
/// answer as for slots by index: the figures of a 1-role store.
#[test]
fn a_budget_of_no_experts_under_role_major_answers() {
    use numapin::NodeSet;
    use numapin::store::{LayerSpec, PinStore};
    let nodes = NodeSet::from_nodes([0]).unwrap();
    let spec = LayerSpec {
        experts: 0,
        weight_bytes: 4096,
        scale_bytes: 64,
    };
    let (done, wait) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let answer = |roles| {
            let options = StoreOptions::default().role_major(roles);
            let store = PinStore::new(Layout::SplitExperts(nodes), options).unwrap();
            store
                .check_model_budget(3, &spec)
                .map_err(|e| e.to_string())
        };
        let _ = done.send((answer(1), answer(usize::MAX)));
    });
    // Not a timing: a hang detector (the walk takes ~2^64 steps).
    let (one, many) = wait
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("check_model_budget with role_major(usize::MAX) hung");
    assert_eq!(one, many);
}

/// As above for [`Checkpoint::pack`] of the routed experts alone: an `Ok` pack of a file
/// cut while it was read held zeros where the cut large folio was (every byte of the
/// file is odd, so a zero byte in a slot is one the file never had).
#[test]
fn a_file_truncated_during_a_pack_is_an_error_or_the_file_bytes() {
    use numapin::store::{PinStore, ReadMode};
    const PIECE: usize = 256 << 10;
    let mut tensors = Vec::new();
    for e in 0..4 {
        for proj in ["gate", "up", "down"] {
            let name = format!("model.layers.0.mlp.experts.{e}.{proj}_proj.weight");
            let bytes: Vec<u8> = (0..PIECE).map(|i| (i % 249) as u8 | 1).collect();
            tensors.push((name, bytes));
        }
    }
    let tensors: Vec<(&str, &str, Vec<u64>, Vec<u8>)> = (tensors.iter())
        .map(|(n, b)| (n.as_str(), "U8", vec![PIECE as u64], b.clone()))
        .collect();
    let (mut packed, mut refused) = (0, 0);
    for mode in [ReadMode::DropBehind, ReadMode::Buffered, ReadMode::Auto] {
        for delay in [0u64, 500, 5_000] {
            let path = write("pack-truncated", &tensors);
            let checkpoint = Checkpoint::open(&path).unwrap();
            let cut = std::fs::metadata(&path).unwrap().len() / 2;
            let truncate = {
                let path = path.clone();
                std::thread::spawn(move || {
                    std::thread::sleep(std::time::Duration::from_micros(delay));
                    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
                    file.set_len(cut).unwrap();
                })
            };
            let options = StoreOptions::default().read_mode(mode).loader_threads(2);
            let store = PinStore::new(Layout::Unplaced, options).unwrap();
            let result = checkpoint.pack(&store);
            truncate.join().unwrap();
            if result.is_err() {
                refused += 1;
                continue;
            }
            packed += 1;
            for e in 0..4 {
                let held = store.weights(0, e).unwrap();
                assert_eq!(held.len(), 3 * PIECE);
                let zero = held.iter().position(|&b| b == 0);
                assert_eq!(zero, None, "{mode:?} {delay}: expert {e}");
            }
        }
    }
    eprintln!("packed {packed}, refused {refused}");
}

/// A manifest whose expert naming (version 2) is a preset, but not the one its expert
/// plan was made with: attached, `PlacedModel::locate` classified the experts' tensors
/// under the other preset (an expert tensor "not an expert"). Refused by parse.
#[test]
fn a_manifest_naming_other_than_its_plans_is_refused() {
    use numapin::model::Naming;
    let path = common::moe_safetensors(&dir("naming"), 64, &[0], 4, (4096, 64));
    let checkpoint = Checkpoint::open(&path).unwrap();
    let mut placed = checkpoint
        .place(&base(), StoreOptions::default().shared(true))
        .unwrap();
    let ours = placed.naming().unwrap().name().to_owned();
    let text = String::from_utf8(placed.export().unwrap().manifest.to_bytes()).unwrap();
    let tail = format!(r#","naming":"{ours}"}}"#);
    assert!(text.ends_with(&tail), "{text}");
    assert!(ModelManifest::parse(text.as_bytes()).is_ok());
    let stem = &text[..text.len() - tail.len()];
    let mut forged: Vec<String> = (Naming::PRESETS.iter())
        .map(|n| n.name())
        .filter(|&n| n != ours)
        .map(|n| format!(r#"{stem},"naming":"{n}"}}"#))
        .collect();
    // A preset naming for a manifest without experts.
    let dense = write(
        "naming-dense",
        &[("model.norm.weight", "U8", vec![4], vec![1; 4])],
    );
    let dense = Checkpoint::open(&dense).unwrap();
    let mut placed = (dense.place(&base(), StoreOptions::default().shared(true))).unwrap();
    let text = String::from_utf8(placed.export().unwrap().manifest.to_bytes()).unwrap();
    assert!(text.ends_with(r#","naming":null}"#), "{text}");
    forged.push(text.replace(r#","naming":null}"#, &format!(r#","naming":"{ours}"}}"#)));
    for forged in forged {
        match ModelManifest::parse(forged.as_bytes()) {
            Err(Error::InvalidArgument {
                reason: reason @ Invalid::BadValue { .. },
                ..
            }) => assert!(reason.to_string().contains("expert naming"), "{reason}"),
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("parsed: …{}", &forged[forged.len() - 40..]),
        }
    }
}

/// The text form of a plan converting to a GGML dtype: `Dtype::Ggml(F32)` was written
/// `convert:F32` and read back as `Dtype::Safetensors(F32)` (another plan), and
/// `Dtype::Ggml(Q8_0)` was written `convert:Q8_0`, which did not read back at all.
#[test]
fn conversions_to_ggml_dtypes_read_back() {
    use numapin::model::{GgmlType, TensorClass};
    for g in [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q8_0,
        GgmlType::I8,
    ] {
        let plan = base()
            .convert_class(TensorClass::NormsAndRouters, Dtype::Ggml(g))
            .convert_pattern("*.gate.weight", Dtype::Ggml(g));
        let text = plan.to_string();
        let back = base().apply(&text);
        assert_eq!(back.as_ref().ok(), Some(&plan), "{g:?}: {text}: {back:?}");
    }
}

/// Held: a drop-behind placement of converted and plain tensors (the converted group
/// packs itself outside the drop-behind record) holds the file's bytes, converted by
/// the bits (BF16 shifted left 16) where asked, of odd element counts.
#[test]
fn a_drop_behind_placement_with_conversions_holds_the_file_bytes() {
    use numapin::store::ReadMode;
    let bf16: Vec<u8> = (0..2 * 12_345).map(|i| (i * 7 % 256) as u8).collect();
    let plain: Vec<u8> = (0..3 * 4099).map(|i| (i * 13 % 256) as u8).collect();
    let tensors = [
        (
            "model.layers.1.self_attn.q_proj.weight",
            "U8",
            vec![3, 4099],
            plain.clone(),
        ),
        (
            "model.layers.0.mlp.gate.weight",
            "BF16",
            vec![12_345],
            bf16.clone(),
        ),
        ("model.norm.weight", "BF16", vec![1], vec![0x80, 0xff]),
    ];
    let path = write("drop-behind", &tensors);
    let checkpoint = Checkpoint::open(&path).unwrap();
    let plan = base()
        .convert_pattern("*.gate.weight", F32)
        .convert_pattern("model.norm.weight", F32);
    let options = StoreOptions::default().read_mode(ReadMode::DropBehind);
    let model = checkpoint.place(&plan, options).unwrap();
    let shifted = |b: &[u8]| -> Vec<u8> {
        b.chunks_exact(2)
            .flat_map(|p| (u32::from(u16::from_le_bytes([p[0], p[1]])) << 16).to_le_bytes())
            .collect()
    };
    assert_eq!(
        model.tensor(tensors[0].0).unwrap().bytes().unwrap(),
        &plain[..]
    );
    assert_eq!(
        model.tensor(tensors[1].0).unwrap().bytes().unwrap(),
        &shifted(&bf16)[..]
    );
    let norm = model.tensor(tensors[2].0).unwrap();
    assert_eq!(norm.bytes().unwrap(), &0xff80_0000u32.to_le_bytes()[..]);
    assert_eq!(norm.dtype(), F32);
    assert!(model.verify(&checkpoint).unwrap().verified());
}

/// Held: a version-1 manifest is refused naming the version; a manifest naming of a
/// megabyte is refused with a bounded message (the naming quoted, clipped).
#[test]
fn old_versions_and_huge_namings_are_refused_briefly() {
    let path = write("v1", &[("model.norm.weight", "U8", vec![4], vec![1; 4])]);
    let checkpoint = Checkpoint::open(&path).unwrap();
    let mut placed = (checkpoint.place(&base(), StoreOptions::default().shared(true))).unwrap();
    let text = String::from_utf8(placed.export().unwrap().manifest.to_bytes()).unwrap();
    let v1 = text.replacen("numapin-model 2", "numapin-model 1", 1);
    let e = ModelManifest::parse(v1.as_bytes()).unwrap_err().to_string();
    assert!(e.contains("unsupported version"), "{e}");
    let huge = "n".repeat(1 << 20);
    let forged = text.replace(r#""naming":null"#, &format!(r#""naming":"{huge}""#));
    let e = ModelManifest::parse(forged.as_bytes())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("expert naming") && e.len() < 1024,
        "{} bytes",
        e.len()
    );
}
