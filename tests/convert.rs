//! Issue 33 item 2: tensors placed in the dtype the framework holds. A class or a name
//! pattern of the plan asks for F32 (transformers keeps routers and router biases in
//! float32 where the file has BF16); the tensor is converted once at placement, its view
//! is F32 with the new byte size, verify compares the placed bytes with the conversion of
//! the file's bytes, the report says what was converted, and the text form reads back.
//! The reference conversion is computed here: BF16 bits shifted left by 16, F16 by its
//! known values.
#![cfg(feature = "model")]

mod common;

use numapin::model::{
    Checkpoint, DenseLayout, Dtype, PlacementPlan, SafetensorsDtype, SliceAxis, TensorClass,
    TensorSlice,
};
use numapin::store::{Layout, StoreOptions};
use numapin::{Error, Node};

const F32: Dtype = Dtype::Safetensors(SafetensorsDtype::F32);

/// F16 bit patterns and their values (1, -2, 0.5, 65504, the smallest subnormal, -0,
/// infinity, 0).
const F16: [(u16, f32); 8] = [
    (0x3c00, 1.0),
    (0xc000, -2.0),
    (0x3800, 0.5),
    (0x7bff, 65504.0),
    (0x0001, 5.960_464_5e-8),
    (0x8000, -0.0),
    (0x7c00, f32::INFINITY),
    (0x0000, 0.0),
];

/// A safetensors file of `(name, dtype, shape, bytes)` in a directory of its own.
fn checkpoint(test: &str, tensors: &[(&str, &str, Vec<u64>, Vec<u8>)]) -> Checkpoint {
    let dir = std::env::temp_dir().join(format!("numapin-convert-{}-{test}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.safetensors");
    std::fs::write(&path, common::safetensors_bytes(tensors)).unwrap();
    Checkpoint::open(&path).unwrap()
}

/// BF16 elements with varied bits (signs, exponents, a NaN pattern).
fn bf16_bytes(n: usize, seed: u16) -> Vec<u8> {
    (0..n)
        .flat_map(|i| {
            (seed
                .wrapping_mul(31)
                .wrapping_add((i as u16).wrapping_mul(2654)))
            .to_le_bytes()
        })
        .collect()
}

fn model() -> Vec<(&'static str, &'static str, Vec<u64>, Vec<u8>)> {
    let f16: Vec<u8> = F16.iter().flat_map(|(h, _)| h.to_le_bytes()).collect();
    vec![
        (
            "model.embed_tokens.weight",
            "BF16",
            vec![4, 8],
            bf16_bytes(32, 1),
        ),
        (
            "model.layers.0.input_layernorm.weight",
            "BF16",
            vec![8],
            bf16_bytes(8, 2),
        ),
        (
            "model.layers.0.mlp.gate.weight",
            "BF16",
            vec![4, 8],
            bf16_bytes(32, 3),
        ),
        (
            "model.layers.0.mlp.gate.e_score_correction_bias",
            "F16",
            vec![8],
            f16,
        ),
        (
            "model.layers.0.self_attn.q_proj.weight",
            "I8",
            vec![4, 8],
            (0..32).collect(),
        ),
        (
            "model.norm.weight",
            "F32",
            vec![2],
            vec![0, 0, 128, 63, 0, 0, 0, 64],
        ),
    ]
}

fn base() -> PlacementPlan {
    PlacementPlan::new(Layout::Unplaced, DenseLayout::Unplaced)
}

/// BF16 → F32 as the bits say: the 16 bits become the top half.
fn bf16_reference(bytes: &[u8]) -> Vec<u8> {
    bytes
        .chunks_exact(2)
        .flat_map(|b| (u32::from(u16::from_le_bytes([b[0], b[1]])) << 16).to_le_bytes())
        .collect()
}

#[test]
fn converted_tensors_are_f32_views_of_the_converted_file_bytes() {
    let tensors = model();
    let checkpoint = checkpoint("views", &tensors);
    let plan = base()
        .convert_class(TensorClass::NormsAndRouters, F32)
        .convert_pattern("*.mlp.gate.*", F32);
    let model = checkpoint.place(&plan, StoreOptions::default()).unwrap();

    let gate = model.tensor("model.layers.0.mlp.gate.weight").unwrap();
    assert_eq!(gate.dtype(), F32);
    assert_eq!(gate.shape(), &[4, 8]);
    assert_eq!(gate.bytes().unwrap(), &bf16_reference(&tensors[2].3)[..]);

    let norm = model
        .tensor("model.layers.0.input_layernorm.weight")
        .unwrap();
    assert_eq!(norm.dtype(), F32);
    assert_eq!(norm.bytes().unwrap(), &bf16_reference(&tensors[1].3)[..]);

    let bias = model
        .tensor("model.layers.0.mlp.gate.e_score_correction_bias")
        .unwrap();
    assert_eq!(bias.dtype(), F32);
    assert_eq!(bias.shape(), &[8]);
    let values: Vec<f32> = bias
        .bytes()
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let want: Vec<f32> = F16.iter().map(|&(_, v)| v).collect();
    assert_eq!(values, want);
    assert_eq!(values[5].to_bits(), (-0.0f32).to_bits());

    // Not asked for, or already F32: as in the file.
    let embed = model.tensor("model.embed_tokens.weight").unwrap();
    assert_eq!(embed.dtype(), Dtype::Safetensors(SafetensorsDtype::BF16));
    assert_eq!(embed.bytes().unwrap(), &tensors[0].3[..]);
    let final_norm = model.tensor("model.norm.weight").unwrap();
    assert_eq!(final_norm.bytes().unwrap(), &tensors[5].3[..]);

    // Verify compares the placed bytes with the conversion of the file's.
    let check = model.verify(&checkpoint).unwrap();
    assert!(check.verified(), "{check:?}");
    assert_eq!(check.mismatched, 0);

    // The report says what was converted, and its plan text reads back.
    let report = model.report().unwrap();
    assert_eq!(report.converted.len(), 3, "{:?}", report.converted);
    assert!(
        report
            .converted
            .iter()
            .any(|l| l.starts_with("model.layers.0.mlp.gate.weight BF16 -> F32 (64 bytes")),
        "{:?}",
        report.converted
    );
    assert!(
        report
            .to_string()
            .contains("converted at placement (3 tensors)")
    );
    assert_eq!(base().apply(&report.plan).unwrap(), plan);
    // The cost counts the converted bytes.
    let cost = checkpoint
        .placement_cost(&plan, &StoreOptions::default())
        .unwrap();
    let norms = cost
        .classes
        .iter()
        .find(|c| c.class == TensorClass::NormsAndRouters)
        .unwrap();
    assert_eq!(norms.bytes, 16 * 2 + 64 * 2 + 16 * 2 + 8);
}

#[test]
fn the_text_form_carries_conversions_and_reads_back() {
    let plan = base()
        .pattern("*.q_proj.*", DenseLayout::Bind(Node(0)))
        .convert_class(TensorClass::NormsAndRouters, F32)
        .convert_pattern("*.mlp.gate.weight", F32)
        .convert_pattern("norms", F32);
    let text = plan.to_string();
    assert!(
        text.ends_with(r#";norms=convert:F32;*.mlp.gate.weight=convert:F32;"norms"=convert:F32"#),
        "{text}"
    );
    assert_eq!(base().apply(&text).unwrap(), plan);
    // The numpy/torch spelling reads as the same dtype.
    let same = base().apply("*.mlp.gate.weight=convert:float32").unwrap();
    assert_eq!(same, base().convert_pattern("*.mlp.gate.weight", F32));
    assert_ne!(same, base());
    for junk in [
        "*.gate.*=convert:float33",
        "norms=convert:",
        "experts=convert:F32",
    ] {
        let err = base().apply(junk).unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument { .. }),
            "{junk}: {err:?}"
        );
    }
    let message = base().apply("*=convert:F33").unwrap_err().to_string();
    assert!(
        message.contains("F33") && message.contains("not a dtype"),
        "{message}"
    );
}

/// Each bad plan is refused by the dry run (which reserves nothing) and by `place`,
/// naming what is wrong.
#[test]
fn bad_conversions_are_named_before_anything_is_reserved() {
    let checkpoint = checkpoint("bad", &model());
    let rows = TensorSlice::part(SliceAxis::Rows, 0, 2).unwrap();
    let cases: [(PlacementPlan, &[&str]); 5] = [
        (
            base().convert_pattern("*.q_proj.*", F32),
            &[
                "model.layers.0.self_attn.q_proj.weight",
                "I8 -> F32",
                "not implemented",
            ],
        ),
        (
            base().convert_pattern("*.gate.weight", Dtype::Safetensors(SafetensorsDtype::BF16)),
            &["model.layers.0.mlp.gate.weight", "BF16", "already"],
        ),
        (
            base().convert_pattern("*.nothing.*", F32),
            &["\"*.nothing.*\"", "matches no dense tensor"],
        ),
        (
            base()
                .slice_pattern("*.mlp.gate.weight", rows)
                .convert_pattern("*.mlp.gate.weight", F32),
            &["model.layers.0.mlp.gate.weight", "sliced"],
        ),
        (
            base().convert_class(TensorClass::RoutedExperts, F32),
            &["experts", "not converted"],
        ),
    ];
    for (plan, words) in cases {
        // A plan whose conversion is a no-op is placed: no error to look for.
        let dry = checkpoint.placement_cost(&plan, &StoreOptions::default());
        if words.contains(&"already") {
            let model = checkpoint.place(&plan, StoreOptions::default()).unwrap();
            assert!(model.report().unwrap().converted.is_empty());
            continue;
        }
        let err = dry.unwrap_err();
        let message = err.to_string();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
        for w in words {
            assert!(message.contains(w), "{w:?} not in {message}");
        }
        let placed = checkpoint
            .place(&plan, StoreOptions::default())
            .unwrap_err();
        assert_eq!(placed.to_string(), message);
    }
}

/// An exported placement attached in the same process: the converted tensors keep their
/// F32 dtype and bytes, and the attached model verifies against the converted file bytes
/// (the manifest carries the file's dtype).
#[test]
fn an_attached_placement_keeps_the_conversion() {
    let tensors = model();
    let checkpoint = checkpoint("attach", &tensors);
    let plan = base().convert_pattern("*.mlp.gate.weight", F32);
    let mut placed = checkpoint
        .place(&plan, StoreOptions::default().shared(true))
        .unwrap();
    let export = placed.export().unwrap();
    let attached = numapin::model::PlacedModel::attach(&export.manifest, export.files).unwrap();
    let gate = attached.tensor("model.layers.0.mlp.gate.weight").unwrap();
    assert_eq!(gate.dtype(), F32);
    assert_eq!(gate.bytes().unwrap(), &bf16_reference(&tensors[2].3)[..]);
    let check = attached.verify(&checkpoint).unwrap();
    assert!(check.verified(), "{check:?}");
}
