//! Pieces at congruent offsets: random, at the edges of the moduli, near `u64::MAX`, tiny
//! and many, under every layout: byte-exact loads or named errors.

use super::*;

#[test]
fn random_pieces_load_byte_exact_in_every_mode_and_congruence() {
    let d = dir("random");
    let path = d.join("data.bin");
    let len = 3 * 1024 * 1024 + 777;
    let bytes = write_file(&path, len, 0x5eed);
    let file = File::open(&path).unwrap();
    let mut rng = Rng(0xdead_beef);
    let aligns = [1usize, 2, 64, 512, 4096];
    let moduli = [0usize, 1, 2, 3, 64, 512, 4096];
    for round in 0..400 {
        let align = aligns[rng.below(aligns.len() as u64) as usize];
        let modulus = moduli[rng.below(moduli.len() as u64) as usize];
        let mode = MODES[rng.below(3) as usize];
        let threads = 1 + rng.below(3) as usize;
        let n_experts = 1 + rng.below(4) as usize;
        let n_pieces = rng.below(6) as usize;
        let mut layout = Vec::new();
        for _ in 0..n_pieces {
            // Offsets: aligned, unaligned, overlapping, repeated, out of order, at EOF.
            let piece_len = match rng.below(5) {
                0 => 0,
                1 => 1 + rng.below(8) as usize,
                2 => 4096,
                3 => rng.below(300_000) as usize,
                _ => 1 + rng.below(5000) as usize,
            };
            let max_off = (len - piece_len) as u64;
            let off = match rng.below(4) {
                0 => rng.below(max_off / 4096 + 1) * 4096,
                1 => max_off,
                2 => rng.below(max_off + 1),
                _ => rng.below(max_off / 512 + 1) * 512,
            };
            layout.push((off, piece_len));
        }
        if layout.iter().all(|&(_, l)| l == 0) {
            layout.push((rng.below(len as u64 - 10), 10));
        }
        let scales: Vec<(u64, usize)> = if rng.below(2) == 0 {
            vec![]
        } else {
            vec![(rng.below(len as u64 - 100), 1 + rng.below(99) as usize)]
        };
        let experts: Vec<_> = (0..n_experts)
            .map(|_| (layout.clone(), scales.clone()))
            .collect();
        let options = StoreOptions::default()
            .huge_pages(false)
            .loader_threads(threads)
            .read_mode(mode)
            .piece_align(align)
            .piece_congruence(modulus)
            .io_uring(round % 3 != 0);
        let what = format!(
            "round {round}: align {align} modulus {modulus} {mode:?} threads {threads} \
             layout {layout:?} scales {scales:?}"
        );
        match pack_and_check(options, &file, &bytes, &experts, &what) {
            Ok(_) => {}
            Err(e) => {
                // Only a refused modulus (not a power of two, or below piece_align) may fail.
                let refused = modulus > 1 && (!modulus.is_power_of_two() || modulus < align);
                assert!(refused, "{what}: {e}");
                assert!(matches!(e, Error::InvalidArgument { .. }), "{what}: {e:?}");
            }
        }
    }
}

#[test]
fn congruence_moduli_at_the_edges_are_named_errors_or_exact_loads() {
    let d = dir("moduli");
    let path = d.join("data.bin");
    let bytes = write_file(&path, 1 << 20, 7);
    let file = File::open(&path).unwrap();
    let experts = vec![(vec![(4096u64, 5000usize), (513, 100), (9000, 4096)], vec![])];
    let huge = [
        3usize,
        4097,
        1 << 21,
        1 << 30,
        (1 << 30) + 1,
        1 << 31,
        1 << 62,
        usize::MAX,
        usize::MAX / 2 + 1,
    ];
    for mode in MODES {
        for slot in [SlotAlign::Page, SlotAlign::HugePage] {
            for &modulus in &huge {
                for align in [1usize, 4096, 1 << 21] {
                    let options = StoreOptions::default()
                        .huge_pages(false)
                        .read_mode(mode)
                        .slot_align(slot)
                        .piece_align(align)
                        .piece_congruence(modulus);
                    let what = format!("{mode:?} {slot:?} align {align} modulus {modulus}");
                    match pack_and_check(options, &file, &bytes, &experts, &what) {
                        Ok(_) => {}
                        Err(e) => assert!(
                            matches!(e, Error::InvalidArgument { .. })
                                && e.to_string().contains("piece_"),
                            "{what}: {e:?}"
                        ),
                    }
                }
            }
        }
    }
}

#[test]
fn pieces_near_u64_max_and_past_eof_are_named_errors() {
    let d = dir("far");
    let path = d.join("data.bin");
    let bytes = write_file(&path, 8192, 9);
    let file = File::open(&path).unwrap();
    let far = [
        (u64::MAX, 1usize),
        (u64::MAX - 4095, 4096),
        (u64::MAX - 4096, 4096),
        (u64::MAX - 1, 2),
        (i64::MAX as u64, 4096),
        (i64::MAX as u64 - 4095, 4096),
        (1u64 << 62, 1),
        (8192, 1),
        (8191, 2),
        (4096, 4097),
        (0, 8193),
        (0, usize::MAX),
        (4096, usize::MAX - 4096),
    ];
    for mode in MODES {
        for modulus in [0usize, 512, 4096] {
            for &(off, len) in &far {
                let options = StoreOptions::default()
                    .huge_pages(false)
                    .read_mode(mode)
                    .piece_align(if modulus == 0 { 1 } else { 512 })
                    .piece_congruence(modulus);
                let experts = vec![(vec![(0u64, 100usize), (off, len)], vec![])];
                let what = format!("{mode:?} modulus {modulus} piece ({off}, {len})");
                let e = pack_and_check(options, &file, &bytes, &experts, &what).expect_err(&what);
                assert!(
                    !matches!(e, Error::Io { .. }) || e.to_string().contains("offset"),
                    "{what}: {e:?}"
                );
            }
        }
    }
}

#[test]
fn one_byte_files_the_same_file_twice_and_many_tiny_pieces() {
    let d = dir("tiny");
    let one = d.join("one.bin");
    let one_bytes = write_file(&one, 1, 11);
    let big = d.join("big.bin");
    let big_bytes = write_file(&big, 1 << 20, 12);
    let f1 = File::open(&one).unwrap();
    let f2 = File::open(&big).unwrap();
    let f2b = File::open(&big).unwrap();
    for mode in MODES {
        for modulus in [0usize, 1, 2, 4096] {
            let options = || {
                StoreOptions::default()
                    .huge_pages(false)
                    .read_mode(mode)
                    .loader_threads(2)
                    .piece_congruence(modulus)
            };
            let what = format!("{mode:?} modulus {modulus}");
            pack_and_check(
                options(),
                &f1,
                &one_bytes,
                &[(vec![(0, 1)], vec![(0, 1)])],
                &what,
            )
            .unwrap();
            // 100k pieces of 1..=3 bytes at scattered offsets; 10k where each piece may
            // take a page of its own (congruent to its file offset modulo 4096), so that the
            // slot stays at 40 MiB, not 400 (the 4-node VM has 768 MiB per node).
            let count = if modulus >= 4096 { 10_000 } else { 100_000 };
            let mut rng = Rng(99);
            let pieces: Vec<(u64, usize)> = (0..count)
                .map(|_| {
                    let l = 1 + rng.below(3) as usize;
                    (rng.below((1 << 20) - 3), l)
                })
                .collect();
            pack_and_check(options(), &f2, &big_bytes, &[(pieces, vec![])], &what).unwrap();
            // Two descriptors of one file in one layer, mixed in one slot.
            let store = PinStore::new(Layout::Unplaced, options()).unwrap();
            let sources = [
                ExpertSource::from_file(&f2, &[(4096, 8192)], &[]),
                ExpertSource::from_file(&f2b, &[(4096, 8192)], &[(1, 3)]),
            ];
            let spec = LayerSpec::fitting(&sources).unwrap();
            store.pack_layer(0, &spec, &sources).unwrap();
            for e in 0..2 {
                let w = store.weights(0, e).unwrap();
                let p = store.slot_map(0).unwrap().pieces(e, Kind::Weights).unwrap()[0];
                assert_eq!(
                    &w[p.offset..p.end()],
                    &big_bytes[4096..4096 + 8192],
                    "{what}"
                );
            }
        }
    }
}

/// Congruent direct loads under every layout (replicas and split blocks included) and in
/// a shared (memfd) store: byte-exact in every copy the lookups reach.
#[test]
fn congruent_loads_under_every_layout_and_shared_store() {
    let d = dir("layouts");
    let path = d.join("data.bin");
    let bytes = write_file(&path, 4 << 20, 41);
    let file = File::open(&path).unwrap();
    let experts: Vec<Pieces> = (0..9u64)
        .map(|e| {
            let at = e * (300 << 10) + e * 17;
            (
                vec![(at, 70_000), (at + 70_000, 5), (at + 90_112, 4096)],
                vec![(at + 200_001, 99)],
            )
        })
        .collect();
    let nodes = numapin::NodeSet::allowed().unwrap();
    let layouts = [
        Layout::Unplaced,
        Layout::Interleave(nodes),
        Layout::LayerPerNode(nodes),
        Layout::Replicate(nodes),
        Layout::SplitExperts(nodes),
    ];
    for layout in layouts {
        for mode in MODES {
            for shared in [false, true] {
                // Replicas are not exported: `PinStore::new` refuses them shared (named).
                if shared && matches!(layout, Layout::Replicate(_)) {
                    continue;
                }
                for modulus in [0usize, 512, 4096] {
                    let options = StoreOptions::default()
                        .huge_pages(false)
                        .loader_threads(2)
                        .read_mode(mode)
                        .shared(shared)
                        .piece_congruence(modulus);
                    let what = format!("{layout:?} {mode:?} shared {shared} modulus {modulus}");
                    pack_and_check_in(layout, options, &file, &bytes, &experts, &what)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                }
            }
        }
    }
}

/// Zero-length pieces anywhere (past the end, at `u64::MAX`, between others, alone in a
/// tensor whose other pieces load): a load equal to the file or a named error.
#[test]
fn zero_length_pieces_far_away_are_harmless() {
    let d = dir("zero");
    let path = d.join("data.bin");
    let bytes = write_file(&path, 1 << 16, 51);
    let file = File::open(&path).unwrap();
    let far = [
        u64::MAX,
        u64::MAX - 1,
        u64::MAX - 4095,
        1 << 63,
        1 << 16,
        (1 << 16) + 1,
    ];
    for mode in MODES {
        for modulus in [0usize, 2, 4096] {
            for &at in &far {
                let experts: Vec<Pieces> = vec![
                    (vec![(0, 100), (at, 0), (4096, 10)], vec![(at, 0)]),
                    (vec![(at, 0), (513, 4096)], vec![]),
                ];
                let options = StoreOptions::default()
                    .huge_pages(false)
                    .read_mode(mode)
                    .piece_congruence(modulus);
                let what = format!("{mode:?} modulus {modulus} zero-length at {at}");
                if let Err(e) = pack_and_check(options, &file, &bytes, &experts, &what) {
                    assert!(
                        matches!(e, Error::InvalidArgument { .. } | Error::Checkpoint { .. }),
                        "{what}: {e:?}"
                    );
                }
            }
        }
    }
}
