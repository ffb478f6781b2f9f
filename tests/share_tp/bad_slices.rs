//! Bad slices are named errors, never a panic: a count that does not divide an axis (a
//! huge one too), a span past the axis, a rank past the count, a 1-D tensor under a
//! column pattern, a pattern that matches nothing, a cut through an FP8 scale block or
//! a GGML block.

use super::common::{self, fixtures, open_fixture};
use super::{base, options};
use numapin::model::{Checkpoint, PlacementPlan, SliceAxis, TensorSlice};
use numapin::store::StoreOptions;

#[test]
fn bad_tp_slices_are_named_errors() {
    let Some(dir) = fixtures("bad_tp_slices_are_named_errors") else {
        return;
    };
    let nodes = common::nodes();
    let opts = StoreOptions::default();
    let st = open_fixture(&dir, "st-sharded");
    let cols = |k, n| TensorSlice::part(SliceAxis::Columns, k, n).unwrap();
    let err = |checkpoint: &Checkpoint, plan: PlacementPlan| {
        let text = checkpoint
            .placement_cost(&plan, &opts)
            .unwrap_err()
            .to_string();
        assert!(checkpoint.place(&plan, options()).is_err(), "{text}");
        text
    };
    // A column slice not dividing the axis names the tensor.
    let text = err(&st, base(nodes).dense_slice(cols(0, 3)));
    assert!(
        text.contains("does not divide") && text.contains('"'),
        "{text}"
    );
    // A huge n, a span from near u64::MAX: no panic, named errors.
    let text = err(&st, base(nodes).dense_slice(cols(0, u64::MAX)));
    assert!(text.contains("does not divide"), "{text}");
    let far = TensorSlice::span(SliceAxis::Columns, u64::MAX - 1, 1).unwrap();
    let text = err(&st, base(nodes).dense_slice(far));
    assert!(text.contains("runs past the axis"), "{text}");
    assert!(TensorSlice::span(SliceAxis::Columns, u64::MAX, 1).is_err());
    let text = err(&st, base(nodes).tensor_parallel(0, u64::MAX).unwrap());
    assert!(text.contains("does not divide"), "{text}");
    // n = 0 and k ≥ n are refused when the preset is set.
    assert!(base(nodes).tensor_parallel(0, 0).is_err());
    assert!(base(nodes).tensor_parallel(2, 2).is_err());
    assert!(base(nodes).tensor_parallel(u64::MAX, 1).is_err());
    // A 1-D tensor under an explicit column pattern.
    let text = err(
        &st,
        base(nodes).slice_pattern("*.input_layernorm.weight", cols(0, 2)),
    );
    assert!(
        text.contains("1-D") && text.contains("input_layernorm"),
        "{text}"
    );
    // A pattern matching nothing names the pattern.
    let text = err(
        &st,
        base(nodes).slice_pattern("*.no_such_proj.*", cols(0, 2)),
    );
    assert!(
        text.contains("no_such_proj") && text.contains("matches no"),
        "{text}"
    );
    // A cut through an FP8 scale block names the block: the FP8 fixture's gate_proj has
    // 160 columns under a grid of 2 (80 a block), and a quarter is 40.
    let fp8 = open_fixture(&dir, "fam-deepseek-v3-fp8");
    let text = err(&fp8, base(nodes).slice_pattern("*.gate_proj.*", cols(0, 4)));
    assert!(
        text.contains("weight_scale_inv") && text.contains("scale blocks of 80"),
        "{text}"
    );
    // The TP preset over the FP8 fixture's MLP: 96 rows under one 128-row block.
    let text = err(&fp8, base(nodes).tensor_parallel(0, 2).unwrap());
    assert!(text.contains("scale blocks"), "{text}");
    // A cut through a GGML block names it: the GGUF fixture's Q8_0 expert down
    // projections have 32 columns, one block; the preset splits down by columns.
    let gguf = open_fixture(&dir, "gguf-single");
    let text = err(&gguf, base(nodes).tensor_parallel(1, 2).unwrap());
    assert!(
        text.contains("Q8_0 blocks of 32 elements") && text.contains("ffn_down_exps"),
        "{text}"
    );
}
