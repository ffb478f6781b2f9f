//! Issue 31 item 8: a placed plan's text form (the report's `plan`) reads back as the
//! same plan whatever its patterns are, and a pattern that matches tensors a later one
//! claims is refused as shadowed, not as matching nothing.
#![cfg(feature = "model")]

use numapin::model::{Checkpoint, DenseLayout, PlacementPlan, SliceAxis, TensorSlice};
use numapin::store::{Layout, StoreOptions};
use numapin::{Error, Node};

/// A safetensors checkpoint of 4-byte U8 tensors named `names` (an 8-byte header length,
/// the JSON header, the data), in a directory of its own.
fn checkpoint(test: &str, names: &[&str]) -> Checkpoint {
    let dir = std::env::temp_dir().join(format!("numapin-plan-text-{}-{test}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let entries: Vec<String> = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            format!(
                r#"{}:{{"dtype":"U8","shape":[2,2],"data_offsets":[{},{}]}}"#,
                serde_json::to_string(name).unwrap(),
                4 * i,
                4 * i + 4
            )
        })
        .collect();
    let header = format!("{{{}}}", entries.join(","));
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend(header.as_bytes());
    file.extend((0..4 * names.len()).map(|b| b as u8));
    let path = dir.join("model.safetensors");
    std::fs::write(&path, file).unwrap();
    Checkpoint::open(&path).unwrap()
}

fn base() -> PlacementPlan {
    PlacementPlan::new(Layout::Unplaced, DenseLayout::Unplaced)
}

/// Before the fix, the report's text of each of these plans read back as another: the
/// pattern `norms` as the norms class's layout, `" padded "` trimmed, `""` and `a;b=c`
/// as errors (and `a;b=c` was refused at placement for the text form's sake).
#[test]
fn patterns_named_like_keys_place_and_their_text_reads_back() {
    let names = ["norms", "dense", "", " padded ", "a;b=c", "x,y", "\"q\""];
    let checkpoint = checkpoint("keys", &names);
    for name in names {
        let plan = base().pattern(name, DenseLayout::Bind(Node(0)));
        let model = checkpoint
            .place(&plan, StoreOptions::default())
            .unwrap_or_else(|e| panic!("{name:?}: {e}"));
        // Placed: the pattern chose its tensor (a pattern that chooses none is refused).
        let text = &model.report().unwrap().plan;
        let back = base().apply(text);
        assert_eq!(back.as_ref().ok(), Some(&plan), "{name:?}: {text}");
    }
}

/// Before the fix: "matches no dense tensor of the checkpoint", although `*norm*`
/// matches two tensors and a later `*` claims both.
#[test]
fn a_shadowed_pattern_is_named_with_the_pattern_that_claims_its_tensors() {
    let checkpoint = checkpoint(
        "shadowed",
        &[
            "model.norm.weight",
            "model.layers.0.input_layernorm.weight",
            "lm_head.weight",
        ],
    );
    let plan = base().apply("*norm*=bind:0;*=unplaced").unwrap();
    let err = checkpoint
        .placement_cost(&plan, &StoreOptions::default())
        .unwrap_err();
    let message = err.to_string();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
    assert!(
        message.contains(r#""*norm*""#)
            && message.contains("matches 2 dense tensor(s)")
            && message.contains(r#"claimed by the later pattern(s) "*""#)
            && !message.contains("matches no dense tensor"),
        "{message}"
    );
    // Two later patterns share its tensors: both named.
    let plan = base()
        .apply("*norm*=bind:0;model.*=unplaced;*layernorm*=unplaced")
        .unwrap();
    let message = checkpoint
        .placement_cost(&plan, &StoreOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        message.contains(r#"later pattern(s) "model.*", "*layernorm*""#),
        "{message}"
    );
    // The same for slice patterns.
    let rows = TensorSlice::part(SliceAxis::Rows, 0, 2).unwrap();
    let plan = base()
        .slice_pattern("lm_*", rows)
        .slice_pattern("*head*", rows);
    let message = checkpoint
        .placement_cost(&plan, &StoreOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        message.contains(r#""lm_*""#)
            && message.contains(
                r#"matches 1 dense tensor(s), every one claimed by the later pattern(s) "*head*""#
            ),
        "{message}"
    );
    // In the right order it places.
    let plan = base().apply("*=unplaced;*norm*=bind:0").unwrap();
    assert!(
        checkpoint
            .placement_cost(&plan, &StoreOptions::default())
            .is_ok()
    );
}
