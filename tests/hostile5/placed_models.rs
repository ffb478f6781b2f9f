//! Whole checkpoints placed in every read mode, congruence and alignment: every tensor
//! equals numpy's bytes, or the options are a named error.

use super::*;

/// `Checkpoint::place` in every read mode with the congruence at 0 (the files' own in
/// direct reads), off, small and page-sized, and piece alignments around it, on every
/// fixture: every tensor equals numpy's bytes where the fixture wrote them, and the
/// placed model re-reads equal in every case.
#[cfg(feature = "model")]
#[test]
fn place_every_fixture_in_every_mode_and_congruence() {
    use numapin::model::{DenseLayout, PlacementPlan};
    let Some(dir) = common::fixtures("place_every_fixture_in_every_mode_and_congruence") else {
        return;
    };
    let nodes = common::nodes();
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| {
            let e = e.unwrap();
            e.path()
                .join("fixture.json")
                .exists()
                .then(|| e.file_name().into_string().unwrap())
        })
        .collect();
    names.sort();
    assert!(names.len() >= 10, "{names:?}");
    for name in &names {
        let checkpoint = common::open_fixture(&dir, name);
        let fixture: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join(name).join("fixture.json")).unwrap())
                .unwrap();
        let layers = fixture["layers"].as_object().unwrap();
        let numpy = dir
            .join(name)
            .join("tensors.json")
            .exists()
            .then(|| common::numpy_tensors(&dir.join(name)));
        for mode in MODES {
            for (align, modulus) in [(1, 0), (1, 1), (1, 2), (64, 4096), (4096, 4096), (2, 0)] {
                let options = StoreOptions::default()
                    .loader_threads(2)
                    .read_mode(mode)
                    .piece_align(align)
                    .piece_congruence(modulus);
                let what = format!("{name} {mode:?} align {align} modulus {modulus}");
                let plan =
                    PlacementPlan::new(Layout::SplitExperts(nodes), DenseLayout::Replicate(nodes));
                let model = checkpoint
                    .place(&plan, options)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                let verify = model.verify(&checkpoint).unwrap();
                assert!(verify.verified(), "{what}: {verify}");
                for (tensor, _, bytes) in numpy.iter().flatten() {
                    let view = model.tensor(tensor).unwrap();
                    match view.bytes() {
                        Some(held) => assert!(held == &bytes[..], "{what} {tensor}"),
                        None => {
                            let layer = view.layer().unwrap();
                            // [E, …], or DBRX's flattened [E·I, …]: E as the script wrote it.
                            let experts = layers[&layer.to_string()].as_u64().unwrap() as usize;
                            let per = bytes.len() / experts;
                            for e in 0..experts {
                                let pieces = model.expert(layer, e).unwrap();
                                let piece = pieces.iter().find(|p| p.tensor == tensor).unwrap();
                                assert!(
                                    piece.bytes == &bytes[e * per..(e + 1) * per],
                                    "{what} {tensor} expert {e}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// A rank's share (experts `1/2`) with a column slice (`columns:1/2`: one strided piece
/// per row) placed in every read mode and congruence: every held expert piece equals
/// numpy's columns of it, and an expert not held is refused.
#[cfg(feature = "model")]
#[test]
fn a_column_sliced_share_places_numpys_columns_in_every_mode() {
    use numapin::model::{DenseLayout, ExpertShare, PlacementPlan, Share, SliceAxis, TensorSlice};
    let Some(dir) = common::fixtures("a_column_sliced_share_places_numpys_columns_in_every_mode")
    else {
        return;
    };
    let name = "st-sharded";
    let checkpoint = common::open_fixture(&dir, name);
    let numpy: std::collections::HashMap<String, (Vec<u64>, Vec<u8>)> =
        common::numpy_tensors(&dir.join(name))
            .into_iter()
            .map(|(n, s, b)| (n, (s, b)))
            .collect();
    let nodes = common::nodes();
    let (k, n) = (1u64, 2u64);
    // Rows too: one piece per role, its shape the rows held.
    for (mode, axis) in MODES
        .into_iter()
        .flat_map(|m| [(m, SliceAxis::Columns), (m, SliceAxis::Rows)])
    {
        for (align, modulus) in [(1, 0), (1, 1), (1, 2), (512, 4096)] {
            let share = Share::default()
                .experts(ExpertShare::part(1, 2).unwrap())
                .slice(TensorSlice::part(axis, k, n).unwrap());
            let plan =
                PlacementPlan::new(Layout::SplitExperts(nodes), DenseLayout::Replicate(nodes))
                    .share(share);
            let options = StoreOptions::default()
                .loader_threads(2)
                .read_mode(mode)
                .piece_align(align)
                .piece_congruence(modulus);
            let what = format!("{mode:?} {axis:?} align {align} modulus {modulus}");
            let model = checkpoint
                .place(&plan, options)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let mut held = 0;
            for layer in 0..4 {
                for e in 0..64 {
                    let pieces = match model.expert(layer, e) {
                        Ok(pieces) => pieces,
                        Err(
                            Error::NotHeld { .. }
                            | Error::NotPacked { .. }
                            | Error::OutOfRange { .. },
                        ) => continue,
                        // Padding between the rows of a column cut: no one byte slice holds
                        // a role, and the view says so instead of showing the padding.
                        Err(err) if axis == SliceAxis::Columns && (align > 1 || modulus > 1) => {
                            assert!(err.to_string().contains("back to back"), "{what}: {err}");
                            held += 1;
                            continue;
                        }
                        Err(err) => panic!("{what}: layer {layer} expert {e}: {err}"),
                    };
                    held += 1;
                    for p in pieces {
                        let (shape, bytes) = &numpy[p.tensor];
                        let numpy = (shape.as_slice(), bytes.as_slice());
                        let want = numpys_part(&p, numpy, e, axis, (k, n), &what);
                        assert!(
                            p.bytes == &want[..],
                            "{what} layer {layer} expert {e} {}",
                            p.tensor
                        );
                    }
                }
            }
            assert!(held > 0, "{what}: no expert held");
            assert!(model.verify(&checkpoint).unwrap().verified(), "{what}");
        }
    }
}

/// Numpy's bytes of what expert `e` holds of a tensor (`shape`, `bytes` as numpy wrote
/// it) under part `k/n` of `axis`, checking the piece's shape on the way.
#[cfg(feature = "model")]
fn numpys_part(
    p: &numapin::model::ExpertPieceView<'_>,
    (shape, bytes): (&[u64], &[u8]),
    e: usize,
    axis: numapin::model::SliceAxis,
    (k, n): (u64, u64),
    what: &str,
) -> Vec<u8> {
    use numapin::model::SliceAxis;
    // A tensor of every expert `[E, ...]` holds more than n of its pieces.
    let (shape, bytes) = if p.bytes.len() * n as usize != bytes.len() {
        let per = bytes.len() / shape[0] as usize;
        (&shape[1..], &bytes[e * per..(e + 1) * per])
    } else {
        (shape, bytes)
    };
    let cols = *shape.last().unwrap();
    let elem = bytes.len() as u64 / shape.iter().product::<u64>();
    let row = (cols * elem) as usize;
    let (from, to) = (
        (k * cols / n * elem) as usize,
        ((k + 1) * cols / n * elem) as usize,
    );
    match axis {
        SliceAxis::Columns => {
            assert_eq!(*p.shape.last().unwrap(), cols / n, "{what} {}", p.tensor);
            bytes
                .chunks(row)
                .flat_map(|r| r[from..to].to_vec())
                .collect()
        }
        SliceAxis::Rows => {
            assert_eq!(p.shape[0], shape[0] / n, "{what} {}", p.tensor);
            let per = bytes.len() / n as usize;
            bytes[k as usize * per..(k as usize + 1) * per].to_vec()
        }
    }
}

/// `Checkpoint::place` with piece alignments and moduli at the edges: a named error
/// before anything is placed, or a model that re-reads equal to the file.
#[cfg(feature = "model")]
#[test]
fn place_with_edge_alignments_is_named_or_exact() {
    use numapin::model::{DenseLayout, PlacementPlan};
    let Some(dir) = common::fixtures("place_with_edge_alignments_is_named_or_exact") else {
        return;
    };
    let nodes = common::nodes();
    let checkpoint = common::open_fixture(&dir, "gguf-single");
    let plan = || PlacementPlan::new(Layout::SplitExperts(nodes), DenseLayout::Replicate(nodes));
    for mode in MODES {
        for slot in [SlotAlign::Page, SlotAlign::HugePage] {
            for (align, modulus) in [
                (1usize, 3usize),
                (1, usize::MAX),
                (1, 1 << 21),
                (1 << 21, 0),
                (1 << 21, 1 << 21),
                (4096, 2048),
                (128, 64),
                (1 << 30, 0),
                (3, 0),
                (0, 0),
                (usize::MAX, 0),
            ] {
                let options = StoreOptions::default()
                    .loader_threads(2)
                    .read_mode(mode)
                    .slot_align(slot)
                    .piece_align(align)
                    .piece_congruence(modulus);
                let what = format!("{mode:?} {slot:?} align {align} modulus {modulus}");
                match checkpoint.place(&plan(), options) {
                    Ok(model) => {
                        let verify = model.verify(&checkpoint).unwrap();
                        assert!(verify.verified(), "{what}: {verify}");
                    }
                    Err(e) => assert!(
                        matches!(
                            e,
                            Error::InvalidArgument { .. }
                                | Error::MapBudget { .. }
                                | Error::NodeMemory { .. }
                        ),
                        "{what}: {e:?}"
                    ),
                }
            }
        }
    }
}
