//! Direct reads landing in place: a file cut mid-unit, random strides, the bounced bytes
//! counted, the layout kept by `ensure` after a release.

use super::*;

/// The file is cut to an unaligned length at the first progress report while pieces laid
/// out congruent to their offsets load in place: an error naming an offset past the cut,
/// in every mode and both ways of issuing direct reads, never wrong bytes or a hang.
#[test]
fn a_file_cut_mid_unit_during_a_congruent_load_is_an_error() {
    use numapin::store::{Progress, ProgressHook};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let d = dir("cut");
    let cut = (24u64 << 20) + 100;
    for (mode, io_uring) in [
        (ReadMode::Direct, true),
        (ReadMode::Direct, false),
        (ReadMode::DropBehind, true),
        (ReadMode::Buffered, true),
    ] {
        for modulus in [512usize, 4096] {
            let path = d.join("data.bin");
            write_file(&path, 64 << 20, 5);
            let file = File::open(&path).unwrap();
            let truncated = Arc::new(AtomicBool::new(false));
            let hook = {
                let (path, truncated) = (path.clone(), truncated.clone());
                ProgressHook::new(move |_: &Progress| {
                    if !truncated.swap(true, Ordering::SeqCst) {
                        let writer = File::options().write(true).open(&path).unwrap();
                        writer.set_len(cut).unwrap();
                    }
                })
            };
            // 256 experts of two pieces each: 256 KiB + 7 at 256 KiB strides, and 3 bytes; the
            // first progress report comes after 16 MiB (`PROGRESS_STEP`).
            let experts: Vec<_> = (0..255u64)
                .map(|e| {
                    (
                        vec![
                            (e * (256 << 10), (256 << 10) + 7),
                            (e * (256 << 10) + 4096, 3),
                        ],
                        vec![],
                    )
                })
                .collect();
            let sources: Vec<_> = experts
                .iter()
                .map(|(w, s): &Pieces| ExpertSource::from_file(&file, w, s))
                .collect();
            let options = StoreOptions::default()
                .huge_pages(false)
                .loader_threads(1)
                .read_mode(mode)
                .io_uring(io_uring)
                .piece_align(512)
                .piece_congruence(modulus)
                .progress(Some(hook));
            let store = PinStore::new(Layout::Unplaced, options).unwrap();
            let what = format!("{mode:?} io_uring {io_uring} modulus {modulus}");
            let e = store
                .pack_layer(0, &LayerSpec::fitting(&sources).unwrap(), &sources)
                .expect_err(&what);
            assert!(truncated.load(Ordering::SeqCst), "{what}");
            let text = e.to_string();
            assert!(text.contains(&path.display().to_string()), "{what}: {text}");
            let offset = text
                .split("file offset ")
                .nth(1)
                .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or_else(|| panic!("{what}: no file offset in {text}"));
            assert!(
                offset + 4096 > cut,
                "{what}: offset {offset} well before the cut: {text}"
            );
            assert!(store.weights(0, 0).is_err(), "{what}");
        }
    }
}

/// Experts back to back in the file (as in a checkpoint), with random bases, strides,
/// gaps and piece lengths: consecutive slots that direct reads batch, some aligned and
/// some not, in every mode and congruence, byte-exact.
#[test]
fn consecutive_experts_with_random_strides_load_byte_exact() {
    let d = dir("consecutive");
    let path = d.join("data.bin");
    let len = (6 << 20) + 4095;
    let bytes = write_file(&path, len, 0xabc);
    let file = File::open(&path).unwrap();
    let mut rng = Rng(0x1234_5678);
    let units = [1u64, 7, 512, 4096, 4096 * 3, 65536];
    for round in 0..150 {
        let unit = units[rng.below(units.len() as u64) as usize];
        let base = rng.below(8) * unit
            + if rng.below(3) == 0 {
                rng.below(4096)
            } else {
                0
            };
        let w_len = (1 + rng.below(40)) as usize * unit as usize
            + rng.below(2) as usize * rng.below(600) as usize;
        let s_len = rng.below(3) as usize * (1 + rng.below(700)) as usize;
        let gap = rng.below(2) * unit * rng.below(3);
        let stride = w_len as u64 + s_len as u64 + gap;
        let n = ((len as u64 - base) / stride).min(1 + rng.below(60)) as usize;
        if n == 0 {
            continue;
        }
        let split = rng.below(2) == 0;
        let experts: Vec<_> = (0..n as u64)
            .map(|e| {
                let at = base + e * stride;
                let w = if split && w_len > 1 {
                    let h = w_len / 2;
                    vec![(at, h), (at + h as u64, w_len - h)]
                } else {
                    vec![(at, w_len)]
                };
                let s = if s_len > 0 {
                    vec![(at + w_len as u64, s_len)]
                } else {
                    vec![]
                };
                (w, s)
            })
            .collect();
        for mode in MODES {
            let modulus = [0usize, 512, 4096][rng.below(3) as usize];
            let align = if modulus == 0 {
                [1usize, 64][rng.below(2) as usize]
            } else {
                [1, 512][rng.below(2) as usize]
            };
            let options = StoreOptions::default()
                .huge_pages(false)
                .loader_threads(1 + rng.below(2) as usize)
                .read_mode(mode)
                .io_uring(rng.below(2) == 0)
                .piece_align(align)
                .piece_congruence(modulus);
            let what = format!(
                "round {round} {mode:?} align {align} modulus {modulus}: base {base} w {w_len} \
                 s {s_len} gap {gap} n {n} split {split}"
            );
            let report = pack_and_check(options, &file, &bytes, &experts, &what)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let total: u64 = experts
                .iter()
                .flat_map(|(w, s)| w.iter().chain(s))
                .map(|&(_, l)| l as u64)
                .sum();
            assert!(
                report.bounced_bytes <= total + 2 * 4096 * (3 * n as u64),
                "{what}: bounced {} of {total}",
                report.bounced_bytes
            );
            if mode != ReadMode::Direct {
                assert_eq!(report.bounced_bytes, 0, "{what}");
            }
        }
    }
}

/// `LayerReport::bounced_bytes` against the count from the file system's own alignment:
/// with the congruence at a page, a piece bounces only its partial offset-alignment units
/// at each end; without it, a piece whose slot address does not follow its offset
/// bounces whole.
#[test]
fn bounced_bytes_count_only_the_partial_units_of_congruent_pieces() {
    let d = dir("bounced");
    let path = d.join("data.bin");
    let bytes = write_file(&path, 32 << 20, 77);
    let file = File::open(&path).unwrap();
    let Some((mem, unit)) = super::common::dio_align(&file) else {
        println!("NOT RUN: no direct I/O under {}", d.display());
        return;
    };
    assert!(mem <= 4096 && unit <= 4096, "({mem}, {unit})");
    // (offset within a 1 MiB stride, length): aligned, head only, tail only, both, tiny.
    let shapes: [(u64, usize); 6] = [
        (0, 8192),
        (100, 8192 - 100),
        (0, 8192 + 100),
        (100, 3 * 4096),
        (4096 + 1, 1),
        (3 * 4096 - 5, 10),
    ];
    for (i, &(off, len)) in shapes.iter().enumerate() {
        let experts: Vec<_> = (0..4u64)
            .map(|e| (vec![((e + 1) << 20 | off, len)], vec![]))
            .collect();
        let partial = |o: u64, l: u64| -> u64 {
            let end = o + l;
            let head_end = o.next_multiple_of(unit).min(end);
            let tail_start = (end / unit * unit).max(head_end);
            (head_end - o) + (end - tail_start)
        };
        let want = 4 * partial(off, len as u64);
        let options = StoreOptions::default()
            .huge_pages(false)
            .loader_threads(1)
            .read_mode(ReadMode::Direct)
            .piece_congruence(4096);
        let what = format!("shape {i} ({off}, {len}) unit {unit}");
        let report = pack_and_check(options, &file, &bytes, &experts, &what).unwrap();
        assert_eq!(report.read_mode, ReadMode::Direct, "{what}");
        assert_eq!(report.bounced_bytes, want, "{what}: congruent");
    }
    // Off, with the first piece at slot offset 0 and the second right after an odd-sized
    // first: only the second's address does not follow its offset.
    let experts: Vec<_> = (0..4u64)
        .map(|e| {
            (
                vec![((e + 1) << 20, 4096), (((e + 1) << 20) + 65536, 8192)],
                vec![],
            )
        })
        .collect();
    let options = StoreOptions::default()
        .huge_pages(false)
        .loader_threads(1)
        .read_mode(ReadMode::Direct)
        .piece_congruence(1);
    let report = pack_and_check(options, &file, &bytes, &experts, "off").unwrap();
    assert_eq!(
        report.bounced_bytes, 0,
        "off, every piece at an aligned slot offset"
    );
    let experts: Vec<_> = (0..4u64)
        .map(|e| {
            (
                vec![((e + 1) << 20, 100), (((e + 1) << 20) + 65536, 8192)],
                vec![],
            )
        })
        .collect();
    let options = StoreOptions::default()
        .huge_pages(false)
        .loader_threads(1)
        .read_mode(ReadMode::Direct)
        .piece_congruence(1);
    let report = pack_and_check(options, &file, &bytes, &experts, "off, odd").unwrap();
    assert_eq!(
        report.bounced_bytes,
        4 * (100 + 8192),
        "off, the second piece at slot offset 100"
    );
}

/// A slot released and loaded again with `ensure` (buffered, piece by piece) gets the
/// layout the pack gave it: pieces at their congruent offsets, padding zero.
#[test]
fn ensure_after_release_keeps_the_congruent_layout() {
    let d = dir("ensure");
    let path = d.join("data.bin");
    let bytes = write_file(&path, 4 << 20, 31);
    let file = File::open(&path).unwrap();
    let experts: Vec<Pieces> = (0..6u64)
        .map(|e| {
            let at = e * (512 << 10);
            (
                vec![(at + 100, 5000), (at + 8192, 4096 + 3), (at + 3, 7)],
                vec![(at + 300_000, 33)],
            )
        })
        .collect();
    for mode in MODES {
        for (align, modulus) in [(1usize, 4096usize), (512, 512), (64, 0), (1, 2)] {
            let options = StoreOptions::default()
                .huge_pages(false)
                .read_mode(mode)
                .piece_align(align)
                .piece_congruence(modulus);
            let what = format!("{mode:?} align {align} modulus {modulus}");
            let mut store = PinStore::new(Layout::Unplaced, options).unwrap();
            let sources: Vec<_> = experts
                .iter()
                .map(|(w, s)| ExpertSource::from_file(&file, w, s))
                .collect();
            store
                .pack_layer(0, &LayerSpec::fitting(&sources).unwrap(), &sources)
                .unwrap();
            let before: Vec<Vec<u8>> = (0..6)
                .map(|e| [store.weights(0, e).unwrap(), store.scales(0, e).unwrap()].concat())
                .collect();
            for e in [0, 3, 5] {
                store.release(0, e).unwrap();
                store.ensure(0, e, &sources[e]).unwrap();
            }
            let map = store.slot_map(0).unwrap().clone();
            for (e, (w, _)) in experts.iter().enumerate() {
                let slot = store.weights(0, e).unwrap();
                for (p, &(off, len)) in map.pieces(e, Kind::Weights).unwrap().iter().zip(w) {
                    assert!(
                        slot[p.offset..p.end()] == bytes[off as usize..off as usize + len],
                        "{what}: expert {e} piece at {off}"
                    );
                }
                let after = [slot, store.scales(0, e).unwrap()].concat();
                assert!(
                    after == before[e],
                    "{what}: expert {e} differs after ensure"
                );
            }
        }
    }
}
