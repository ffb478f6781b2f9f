//! `StoreOptions::piece_align`: every piece of every fixture at a multiple of it inside
//! its slot with the bytes exact and the padding zero, a released expert reloaded into
//! the same places, and an alignment that is not a power of two refused.

use super::common::fixtures;
use super::{FIXTURES, Fixture, pieces, store};
use numapin::model::{Checkpoint, TensorPiece};
use numapin::store::{ExpertSource, Kind, Layout, PinStore, StoreOptions};
use numapin::{Error, Invalid};

/// `piece_align = 4096`: every piece starts at a multiple of 4096 inside its slot, the
/// bytes of each piece are exact, the padding is zero, the slots grew, and a released
/// expert reloads into the same places.
#[test]
fn piece_align_puts_every_piece_at_a_multiple_and_keeps_the_bytes() {
    let Some(dir) = fixtures("piece_align_puts_every_piece_at_a_multiple") else {
        return;
    };
    const ALIGN: usize = 4096;
    let mut padded_slots = 0;
    for name in FIXTURES {
        let f = Fixture::open(&dir, name);
        let plan = f.checkpoint.expert_plan().unwrap();
        let mut store = store(ALIGN);
        let report = f.checkpoint.pack(&store).unwrap();
        assert_eq!(report.bytes, f.expected_bytes());
        for (&layer, &experts) in &f.layers() {
            let map = store.slot_map(layer).unwrap().clone();
            assert_eq!(map.piece_align(), ALIGN);
            let r = report
                .layer_reports
                .iter()
                .find(|r| r.layer == layer)
                .unwrap();
            for e in 0..experts {
                for kind in Kind::ALL {
                    let from_plan = pieces(&plan, layer, e, kind);
                    let places = map.pieces(e, kind).unwrap();
                    assert_eq!(places.len(), from_plan.len());
                    let slot = match kind {
                        Kind::Weights => store.weights(layer, e).unwrap(),
                        Kind::Scales => store.scales(layer, e).unwrap(),
                    };
                    let Some(want) = f.expected(layer, e, kind) else {
                        assert!(slot.is_empty());
                        continue;
                    };
                    // numpy's bytes, cut at the piece lengths, each at its aligned place.
                    let mut cut = 0;
                    let mut covered = vec![false; slot.len()];
                    for (i, (place, piece)) in places.iter().zip(from_plan).enumerate() {
                        assert_eq!(place.offset % ALIGN, 0, "{name} L{layer} E{e} piece {i}");
                        assert_eq!(place.len as u64, piece.len());
                        assert!(slot[place.offset..place.end()] == want[cut..cut + place.len]);
                        covered[place.offset..place.end()].fill(true);
                        cut += place.len;
                    }
                    assert_eq!(cut, want.len());
                    assert!(slot.iter().zip(&covered).all(|(&b, &c)| c || b == 0));
                    let stride = match kind {
                        Kind::Weights => r.weight_stride,
                        Kind::Scales => r.scale_stride,
                    };
                    assert!(stride >= places.last().unwrap().end());
                    // The slot grew by the padding: each piece but the last rounded up.
                    let (last, before) = from_plan.split_last().unwrap();
                    let grown: u64 = before
                        .iter()
                        .map(|p| p.len().next_multiple_of(ALIGN as u64))
                        .sum::<u64>()
                        + last.len();
                    assert_eq!(slot.len() as u64, grown);
                    padded_slots += usize::from(slot.len() > want.len());
                }
            }
        }
        assert!(f.checkpoint.verify(&store).unwrap().verified());

        // Release one expert and ensure it again from its pieces: same places, same bytes.
        let layer = plan.layers()[0].layer();
        let before = store.weights(layer, 1).unwrap().to_vec();
        let source = ExpertSource::File {
            weights: source_pieces(&f.checkpoint, pieces(&plan, layer, 1, Kind::Weights)),
            scales: source_pieces(&f.checkpoint, pieces(&plan, layer, 1, Kind::Scales)),
        };
        store.release(layer, 1).unwrap();
        assert!(matches!(
            store.weights(layer, 1),
            Err(Error::Released { .. })
        ));
        assert!(matches!(
            f.checkpoint.verify(&store),
            Err(Error::Released { .. })
        ));
        store.ensure(layer, 1, &source).unwrap();
        assert!(store.weights(layer, 1).unwrap() == before);
        assert_eq!(
            store.slot_map(layer).unwrap().pieces(1, Kind::Weights),
            store.slot_map(layer).unwrap().pieces(0, Kind::Weights)
        );
        assert!(f.checkpoint.verify(&store).unwrap().verified());
    }
    assert!(
        padded_slots > 0,
        "no fixture has a piece that is not a multiple of {ALIGN}"
    );
}

fn source_pieces<'a>(
    checkpoint: &'a Checkpoint,
    pieces: &[TensorPiece],
) -> Vec<numapin::store::Piece<'a>> {
    pieces
        .iter()
        .map(|p| {
            numapin::store::Piece::new(
                checkpoint.files()[p.file()].file(),
                p.offset(),
                p.len() as usize,
            )
        })
        .collect()
}

#[test]
fn piece_align_must_be_a_power_of_two() {
    for (align, ok) in [
        (0, false),
        (3, false),
        (4097, false),
        (1, true),
        (2, true),
        (1 << 21, true),
    ] {
        let options = StoreOptions::default().piece_align(align);
        match PinStore::new(Layout::Unplaced, options) {
            Ok(_) => assert!(ok, "{align}"),
            Err(Error::InvalidArgument {
                reason:
                    reason @ Invalid::BadValue {
                        what: "piece_align",
                        ..
                    },
                ..
            }) => {
                assert!(!ok, "{align}");
                let Invalid::BadValue { value, .. } = &reason else {
                    unreachable!()
                };
                assert_eq!(*value, align.to_string());
                let reason = reason.to_string();
                assert!(reason.contains(&format!("piece_align {align}")), "{reason}");
            }
            Err(other) => panic!("{align}: {other:?}"),
        }
    }
}
