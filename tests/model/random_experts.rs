//! Randomized expert headers: names from the generic vocabulary (per-expert, merged,
//! flattened, biases, MXFP4 blocks and scales), shapes consistent or not.

use super::*;
use proptest::prelude::*;

/// One tensor: (layer, expert or merged, word, suffix or kind, dims, F32?).
fn tensor() -> impl Strategy<Value = (String, bool, Vec<u64>)> {
    let layer = prop_oneof![0usize..3, Just(999_999_999)];
    let expert = prop_oneof![
        4 => (0usize..4).prop_map(Some),
        1 => prop_oneof![Just(65_535usize), Just(65_536), Just(999_999_999)].prop_map(Some),
        4 => Just(None),
    ];
    let word = prop::sample::select(vec![
        "gate_proj",
        "up_proj",
        "down_proj",
        "gate_up_proj",
        "w1",
        "v1",
        "w2",
        "input_linear",
        "output_linear",
    ]);
    let kind = prop::sample::select(vec![
        ".weight",
        ".weight_scale_inv",
        "_bias",
        "_blocks",
        "_scales",
        "",
        ".mlp",
    ]);
    let dims = prop::collection::vec(0u64..6, 0..4);
    (layer, expert, word, kind, dims, any::<bool>()).prop_map(
        |(layer, expert, word, kind, dims, f32)| {
            let p = format!("model.layers.{layer}.mlp");
            let name = match (expert, kind) {
                (Some(e), _) => format!("{p}.experts.{e}.{word}{kind}"),
                (None, ".mlp") => format!("transformer.blocks.{layer}.ffn.experts.mlp.{word}"),
                (None, _) if word.ends_with("linear") => format!("{p}.{word}{kind}"),
                (None, _) => format!("{p}.experts.{word}{kind}"),
            };
            (name, f32, dims)
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(192))]

    /// No panic; a plan is complete with every piece inside its file and one piece per
    /// role, or the error is a typed checkpoint error.
    #[test]
    fn random_expert_headers_plan_whole_or_fail_typed(
        tensors in prop::collection::vec(tensor(), 1..12)
    ) {
        let dir = scratch("random-experts");
        let mut seen = std::collections::BTreeSet::new();
        let tensors: Vec<(&str, &str, &[u64])> = tensors
            .iter()
            .filter(|(n, _, _)| seen.insert(n.clone()))
            .map(|(n, f32, d)| (n.as_str(), if *f32 { "F32" } else { "F16" }, d.as_slice()))
            .collect();
        write_st(&dir, "m.safetensors", &tensors);
        let checkpoint = Checkpoint::open(dir.join("m.safetensors")).unwrap();
        let file_len = checkpoint.files()[0].file().metadata().unwrap().len();
        for naming in Naming::PRESETS {
            match naming.plan(&checkpoint) {
                Ok(plan) => {
                    prop_assert!(plan.is_complete());
                    for layer in plan.layers() {
                        prop_assert!(layer.experts().len() <= numapin::model::MAX_EXPERTS_PER_LAYER);
                        for e in layer.experts() {
                            let w: u64 = e.weights().iter().map(|p| p.len()).sum();
                            let s: u64 = e.scales().iter().map(|p| p.len()).sum();
                            prop_assert_eq!((w, s), (layer.weight_bytes(), layer.scale_bytes()));
                            for p in e.weights().iter().chain(e.scales()) {
                                prop_assert!(p.offset() + p.len() <= file_len);
                            }
                        }
                    }
                }
                Err(Error::Checkpoint { .. }) => {}
                Err(other) => prop_assert!(false, "{}: {other:?}", naming.name()),
            }
        }
    }
}
