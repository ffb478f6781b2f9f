//! The slot layout's tests: pieces placed, jobs cut, options checked.

use super::*;
use crate::source::{Piece, Tensor};
use std::fs::File;

fn file() -> File {
    File::open("/proc/self/exe").unwrap()
}

fn offsets(places: &[SlotPiece]) -> Vec<(usize, usize)> {
    places.iter().map(|p| (p.offset, p.len)).collect()
}

#[test]
fn pieces_go_back_to_back_or_at_multiples_of_the_alignment() {
    let f = file();
    let source = ExpertSource::from_file(&f, &[(0, 100), (100, 28), (500, 1)], &[(9, 3)]);
    let what = || "test".to_string();
    let back = places(&what, &source, Kind::Weights, PieceLayout::aligned(1)).unwrap();
    assert_eq!(offsets(&back), [(0, 100), (100, 28), (128, 1)]);
    let aligned = places(&what, &source, Kind::Weights, PieceLayout::aligned(64)).unwrap();
    assert_eq!(offsets(&aligned), [(0, 100), (128, 28), (192, 1)]);
    assert_eq!(extent(&aligned), 193);
    let scales = places(&what, &source, Kind::Scales, PieceLayout::aligned(64)).unwrap();
    assert_eq!(offsets(&scales), [(0, 3)]);
    let empty = ExpertSource::Memory {
        weights: &[1, 2],
        scales: &[],
    };
    assert_eq!(
        offsets(&places(&what, &empty, Kind::Weights, PieceLayout::aligned(4096)).unwrap()),
        [(0, 2)]
    );
    assert!(
        places(&what, &empty, Kind::Scales, PieceLayout::aligned(4096))
            .unwrap()
            .is_empty()
    );
}

#[test]
fn joined_pieces_follow_the_one_before_whatever_the_alignment() {
    // The strided rows of a column slice: the first aligned, the rest back to back, and
    // the next tensor aligned again; a joined first piece has nothing to join.
    let f = file();
    let source = ExpertSource::File {
        weights: vec![
            Piece::new(&f, 7, 10).joined(),
            Piece::new(&f, 100, 24),
            Piece::new(&f, 200, 24).joined(),
            Piece::new(&f, 300, 24).joined(),
            Piece::new(&f, 1000, 5),
        ],
        scales: vec![],
    };
    let what = || "test".to_string();
    let layout = PieceLayout {
        align: 64,
        modulus: 4096,
    };
    let placed = places(&what, &source, Kind::Weights, layout).unwrap();
    // 7 is not 64-aligned in the file: the plain alignment; 100 likewise.
    assert_eq!(
        offsets(&placed),
        [(0, 10), (64, 24), (88, 24), (112, 24), (192, 5)]
    );
}

#[test]
fn offsets_that_overflow_are_an_error() {
    let f = file();
    let source = ExpertSource::File {
        weights: vec![Piece::new(&f, 0, usize::MAX - 10), Piece::new(&f, 0, 1)],
        scales: vec![],
    };
    let what = || "layer 7".to_string();
    let err = places(&what, &source, Kind::Weights, PieceLayout::aligned(64)).unwrap_err();
    assert!(err.to_string().contains("layer 7"), "{err}");
}

#[test]
fn touching_pieces_are_one_job_and_padding_splits_jobs() {
    let f = file();
    let pieces = [
        Piece::new(&f, 0, 10),
        Piece::new(&f, 10, 6),
        Piece::new(&f, 100, 4),
    ];
    let tensor = Tensor::File(&pieces);
    let mut slot = vec![0u8; 64];
    let what = (1, 2, Kind::Weights);
    let back = [
        SlotPiece { offset: 0, len: 10 },
        SlotPiece { offset: 10, len: 6 },
        SlotPiece { offset: 16, len: 4 },
    ];
    let jobs = jobs(&back, &mut slot, tensor, what).unwrap();
    assert_eq!(jobs.len(), 1);
    assert_eq!(jobs[0].dest.len(), 20);
    drop(jobs);
    let padded = [
        SlotPiece { offset: 0, len: 10 },
        SlotPiece { offset: 16, len: 6 },
        SlotPiece { offset: 22, len: 4 },
    ];
    let split = super::jobs(&padded, &mut slot, tensor, what).unwrap();
    let shape: Vec<(usize, usize)> = split
        .iter()
        .map(|j| {
            let Tensor::File(p) = j.tensor else {
                unreachable!()
            };
            (j.dest.len(), p.len())
        })
        .collect();
    assert_eq!(shape, [(10, 1), (10, 2)]);
    drop(split);
    let too_far = [
        SlotPiece { offset: 0, len: 10 },
        SlotPiece { offset: 60, len: 6 },
        SlotPiece { offset: 66, len: 4 },
    ];
    assert!(super::jobs(&too_far, &mut slot, tensor, what).is_err());
    assert!(super::jobs(&back[..2], &mut slot, tensor, what).is_err());
}

#[test]
fn experts_with_one_layout_share_it_and_set_changes_one() {
    let f = file();
    let sources: Vec<ExpertSource> = (0..3)
        .map(|e| ExpertSource::from_file(&f, &[(e * 100, 50), (e * 100 + 50, 50)], &[]))
        .collect();
    let mut map = SlotMap::build(0, &sources, PieceLayout::aligned(1)).unwrap();
    assert_eq!(map.places.len(), 1);
    assert_eq!(map.experts(), 3);
    assert_eq!(
        offsets(map.uniform(Kind::Weights).unwrap()),
        [(0, 50), (50, 50)]
    );
    let spec = LayerSpec {
        experts: 3,
        weight_bytes: 100,
        scale_bytes: 0,
    };
    assert_eq!(map.grown(&spec), spec);
    map.set(
        1,
        Kind::Weights,
        vec![SlotPiece {
            offset: 0,
            len: 100,
        }],
    );
    assert_eq!(map.uniform(Kind::Weights), None);
    assert_eq!(offsets(map.pieces(1, Kind::Weights).unwrap()), [(0, 100)]);
    assert_eq!(
        offsets(map.pieces(2, Kind::Weights).unwrap()),
        [(0, 50), (50, 50)]
    );
    assert_eq!(map.pieces(3, Kind::Weights), None);
    let aligned = SlotMap::build(0, &sources, PieceLayout::aligned(4096)).unwrap();
    assert_eq!(aligned.grown(&spec).weight_bytes, 4096 + 50);
}

/// The pieces of a dense group: file offsets and lengths as a GGUF file at 32-byte
/// alignment has them (some at 32 mod 64), one 100 bytes past its predecessor.
const FILE: [(u64, usize); 5] = [
    (4096 + 64, 8192),
    (4096 + 64 + 8192, 256),            // continues the previous one
    (4096 + 64 + 8192 + 256 + 32, 100), // 32 mod 64: the alignment wins
    (20_000 * 64, 4032),
    (20_000 * 64 + 4032 + 128, 64), // a gap of 128 bytes: mirrored
];

#[test]
fn congruent_pieces_follow_their_file_offsets_modulo_the_modulus() {
    let f = file();
    let source = ExpertSource::from_file(&f, &FILE, &[]);
    let what = || "test".to_string();
    for modulus in [512usize, 4096] {
        let layout = PieceLayout { align: 64, modulus };
        let places = places(&what, &source, Kind::Weights, layout).unwrap();
        let mut end = 0;
        for (p, &(offset, len)) in places.iter().zip(&FILE) {
            assert_eq!(p.len, len);
            assert!(p.offset >= end, "{places:?}");
            assert!(p.offset.is_multiple_of(64), "{places:?}");
            if offset.is_multiple_of(64) {
                // Congruent, and no more padding than one modulus.
                assert_eq!(p.offset as u64 % modulus as u64, offset % modulus as u64);
                assert!(p.offset - end < modulus, "{places:?}");
            } else {
                // The alignment wins: the next multiple of 64.
                assert_eq!(p.offset, end.next_multiple_of(64));
            }
            end = p.end();
        }
        // Contiguous in the file, contiguous in the slot; a gap mirrored.
        assert_eq!(places[1].offset, places[0].end());
        assert_eq!(places[4].offset, places[3].end() + 128);
        assert_eq!(places[0].offset, (4096 + 64) % modulus);
    }
    // Off (0 and 1): today's layout.
    for off in [0, 1] {
        let layout = PieceLayout {
            align: 64,
            modulus: off,
        };
        assert_eq!(
            places(&what, &source, Kind::Weights, layout).unwrap(),
            places(&what, &source, Kind::Weights, PieceLayout::aligned(64)).unwrap()
        );
    }
}

#[test]
fn a_congruent_layout_runs_as_one_job_per_file_run() {
    let f = file();
    let source = ExpertSource::from_file(&f, &FILE, &[]);
    let layout = PieceLayout {
        align: 64,
        modulus: 4096,
    };
    let places = places(&|| "t".into(), &source, Kind::Weights, layout).unwrap();
    let mut slot = vec![0u8; extent(&places)];
    let jobs = jobs(
        &places,
        &mut slot,
        source.tensor(Kind::Weights),
        (0, 0, Kind::Weights),
    )
    .unwrap();
    // Pieces 0-1 touch; 2 (32 bytes further in the file, 32 mod 64) goes to the next
    // multiple of 64, where 1 ends, so it touches too (its read is its own: the file
    // has a gap); 3 starts at its congruent offset, 4 after the mirrored gap.
    let runs: Vec<usize> = jobs
        .iter()
        .map(|j| match j.tensor {
            Tensor::File(p) => p.len(),
            Tensor::Memory(_) => 0,
        })
        .collect();
    assert_eq!(runs, [3, 1, 1]);
}

#[test]
fn bad_moduli_are_refused_by_name() {
    let page = crate::page::page_size();
    for modulus in [0, 1, 64, 512, page] {
        check_piece_congruence(modulus, 64, page).unwrap();
    }
    for (modulus, words) in [
        (3, "power of two"),
        (usize::MAX, "power of two"),
        (crate::store::MAX_ALIGN * 2, "larger than"),
        (32, "smaller than piece_align 64"),
        (page * 2, "slot alignment"),
    ] {
        let e = check_piece_congruence(modulus, 64, page).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("piece_congruence") && text.contains(words),
            "{modulus}: {text}"
        );
    }
    let store = |m| {
        PinStore::new(
            crate::store::Layout::Unplaced,
            crate::store::StoreOptions::default()
                .piece_align(64)
                .piece_congruence(m),
        )
    };
    assert!(store(3).is_err() && store(usize::MAX).is_err());
    assert!(store(0).is_ok() && store(4096.min(page)).is_ok());
}

#[test]
fn congruent_offsets_that_overflow_are_an_error() {
    let f = file();
    let layout = PieceLayout {
        align: 64,
        modulus: 4096,
    };
    let what = || "layer 9".to_string();
    // A piece at the top of the file offsets, after one that fills the slot offsets.
    let top = u64::MAX - 4095; // a multiple of 4096: congruent to 0
    let source = ExpertSource::File {
        weights: vec![Piece::new(&f, 1, usize::MAX - 100), Piece::new(&f, top, 1)],
        scales: vec![],
    };
    let e = places(&what, &source, Kind::Weights, layout).unwrap_err();
    assert!(e.to_string().contains("layer 9"), "{e}");
    let near = ExpertSource::File {
        weights: vec![Piece::new(&f, u64::MAX - 63, 10)],
        scales: vec![],
    };
    let p = places(&what, &near, Kind::Weights, layout).unwrap();
    assert_eq!(p[0].offset as u64, (u64::MAX - 63) % 4096);
    assert_eq!(layout.offset(usize::MAX - 10, 0), None);
    assert_eq!(layout.offset(usize::MAX - 10, u64::MAX - 63), None);
}
