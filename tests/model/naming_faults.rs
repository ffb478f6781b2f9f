//! Naming faults (safetensors checkpoints made here).

use super::*;

fn expert(l: usize, e: usize, p: &str) -> String {
    format!("model.layers.{l}.mlp.experts.{e}.{p}_proj.weight")
}

#[test]
fn naming_layer_missing_an_expert_and_different_shapes() {
    let dir = scratch("naming");
    let names: Vec<String> = [0, 1, 3]
        .iter()
        .flat_map(|&e| ["gate", "up", "down"].map(|p| expert(1, e, p)))
        .collect();
    let tensors: Vec<(&str, &str, &[u64])> = names
        .iter()
        .map(|n| (n.as_str(), "F16", &[4u64, 2][..]))
        .collect();
    write_st(&dir, "m.safetensors", &tensors);
    let checkpoint = Checkpoint::open(dir.join("m.safetensors")).unwrap();
    let (kind, reason) = match checkpoint.expert_plan() {
        Err(Error::Checkpoint { kind, reason, .. }) => (kind, reason),
        other => panic!("{other:?}"),
    };
    assert_eq!(kind, CheckpointFault::Missing);
    assert!(
        reason.contains("layer 1") && reason.contains("expert 2"),
        "{reason}"
    );

    let names: Vec<String> = [0, 1]
        .iter()
        .flat_map(|&e| ["gate", "up", "down"].map(|p| expert(1, e, p)))
        .collect();
    let mut tensors: Vec<(&str, &str, &[u64])> = names
        .iter()
        .map(|n| (n.as_str(), "F16", &[4u64, 2][..]))
        .collect();
    tensors[4].2 = &[2, 4];
    write_st(&dir, "m.safetensors", &tensors);
    let checkpoint = Checkpoint::open(dir.join("m.safetensors")).unwrap();
    match checkpoint.expert_plan() {
        Err(Error::Checkpoint {
            kind: CheckpointFault::Shape,
            tensor,
            reason,
            ..
        }) => {
            assert_eq!(tensor.as_deref(), Some(names[4].as_str()));
            assert!(
                reason.contains("experts of one layer with different shapes"),
                "{reason}"
            );
        }
        other => panic!("{other:?}"),
    }
}

/// A layer with a bias must have one for each weight role; a bias whose expert count
/// disagrees with the weights' is a shape error naming it.
#[test]
fn naming_biases_complete_and_counted() {
    let dir = scratch("biases");
    let p = "model.layers.0.mlp.experts";
    let (gu, dn) = (format!("{p}.gate_up_proj"), format!("{p}.down_proj"));
    let (gub, dnb) = (format!("{gu}_bias"), format!("{dn}_bias"));
    write_st(
        &dir,
        "m.safetensors",
        &[
            (&gu, "F32", &[4, 8, 8]),
            (&dn, "F32", &[4, 4, 8]),
            (&gub, "F32", &[4, 8]),
        ],
    );
    let checkpoint = Checkpoint::open(dir.join("m.safetensors")).unwrap();
    assert_eq!(Naming::detect(&checkpoint).unwrap().name(), "generic");
    match checkpoint.expert_plan() {
        Err(Error::Checkpoint {
            kind: CheckpointFault::Missing,
            reason,
            ..
        }) => assert!(reason.contains("has no down bias"), "{reason}"),
        other => panic!("{other:?}"),
    }

    write_st(
        &dir,
        "m.safetensors",
        &[
            (&gu, "F32", &[4, 8, 8]),
            (&dn, "F32", &[4, 4, 8]),
            (&gub, "F32", &[4, 8]),
            (&dnb, "F32", &[3, 8]),
        ],
    );
    let checkpoint = Checkpoint::open(dir.join("m.safetensors")).unwrap();
    match checkpoint.expert_plan() {
        Err(Error::Checkpoint {
            kind: CheckpointFault::Shape,
            tensor,
            ..
        }) => assert_eq!(tensor.as_deref(), Some(dnb.as_str())),
        other => panic!("{other:?}"),
    }

    write_st(
        &dir,
        "m.safetensors",
        &[
            (&gu, "F32", &[4, 8, 8]),
            (&dn, "F32", &[4, 4, 8]),
            (&gub, "F32", &[4, 8]),
            (&dnb, "F32", &[4, 8]),
        ],
    );
    let checkpoint = Checkpoint::open(dir.join("m.safetensors")).unwrap();
    let plan = checkpoint.expert_plan().unwrap();
    let layer = plan.layer(0).unwrap();
    let roles: Vec<(PieceRole, &str)> = layer.roles().collect();
    assert_eq!(
        roles,
        [
            (PieceRole::Weight, "gate_up"),
            (PieceRole::Weight, "down"),
            (PieceRole::Scale, "gate_up bias"),
            (PieceRole::Scale, "down bias"),
        ]
    );
    assert_eq!((layer.weight_bytes(), layer.scale_bytes()), (384, 64));
    assert_eq!(layer.gate_up_layout(), Some(GateUpLayout::Interleaved));
}

#[test]
fn naming_no_experts_lists_lookalikes_and_custom_naming_works() {
    let dir = scratch("no-experts");
    write_st(
        &dir,
        "m.safetensors",
        &[
            ("layers.0.moe.experts.0.fc1", "F16", &[2, 2]),
            ("layers.0.moe.experts.1.fc1", "F16", &[2, 2]),
            ("embed", "F32", &[4]),
        ],
    );
    let checkpoint = Checkpoint::open(dir.join("m.safetensors")).unwrap();
    match checkpoint.expert_plan() {
        Err(Error::Checkpoint {
            kind: CheckpointFault::NoExperts,
            reason,
            ..
        }) => {
            assert!(reason.contains("layers.0.moe.experts.0.fc1"), "{reason}");
            assert!(reason.contains("layers.0.moe.experts.1.fc1"), "{reason}");
            assert!(!reason.contains("embed"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    let naming = Naming::Custom(numapin::model::CustomNaming::new("fc1", |name| {
        let rest = name.strip_prefix("layers.")?;
        let (layer, rest) = rest.split_once(".moe.experts.")?;
        let expert = rest.strip_suffix(".fc1")?;
        Some(numapin::model::TensorRef {
            layer: layer.parse().ok()?,
            expert: Some(expert.parse().ok()?),
            piece: 0,
            scale: false,
        })
    }));
    let plan = checkpoint.expert_plan_with(&naming).unwrap();
    assert_eq!(plan.naming(), "fc1");
    assert_eq!(plan.layers().len(), 1);
    assert_eq!(plan.layers()[0].experts().len(), 2);
    assert_eq!((plan.engine_tensors(), plan.engine_bytes()), (1, 16));
    let e1 = &plan.layers()[0].experts()[1].weights()[0];
    let t = checkpoint.tensor("layers.0.moe.experts.1.fc1").unwrap();
    assert_eq!((e1.offset(), e1.len()), (t.offset(), t.len()));
}
