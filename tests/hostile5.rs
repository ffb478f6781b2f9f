//! Hostile inputs for round 5's surface: `StoreOptions::piece_congruence` with direct
//! reads landing in place, drop-behind's bookkeeping, and the layer reports' bounced
//! bytes. Every load is compared with the file's own bytes (read back with std), and
//! every bad option must be a named error, never a panic.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use numapin::Error;
use numapin::store::{
    ExpertSource, Kind, LayerSpec, Layout, PinStore, ReadMode, SlotAlign, StoreOptions,
};

fn dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("hostile5-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A small deterministic generator (xorshift64*), so that a failure replays.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
}

fn write_file(path: &Path, len: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng(seed | 1);
    let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
    let mut f = File::create(path).unwrap();
    f.write_all(&bytes).unwrap();
    f.sync_all().unwrap();
    bytes
}

/// One expert's file pieces: weights, scales (offset, length).
type Pieces = (Vec<(u64, usize)>, Vec<(u64, usize)>);

const MODES: [ReadMode; 3] = [ReadMode::Buffered, ReadMode::Direct, ReadMode::DropBehind];

/// Packs `weights`/`scales` pieces of `file` for `experts` experts and checks every piece's
/// bytes against `bytes` at the slot map's offsets, and the padding zero.
fn pack_and_check(
    options: StoreOptions,
    file: &File,
    bytes: &[u8],
    experts: &[Pieces],
    what: &str,
) -> Result<numapin::store::LayerReport, Error> {
    pack_and_check_in(Layout::Unplaced, options, file, bytes, experts, what)
}

/// [`pack_and_check`] under `layout`.
fn pack_and_check_in(
    layout: Layout,
    options: StoreOptions,
    file: &File,
    bytes: &[u8],
    experts: &[Pieces],
    what: &str,
) -> Result<numapin::store::LayerReport, Error> {
    let store = PinStore::new(layout, options)?;
    let sources: Vec<ExpertSource<'_>> = experts
        .iter()
        .map(|(w, s)| ExpertSource::from_file(file, w, s))
        .collect();
    let spec = LayerSpec::fitting(&sources)?;
    let report = store.pack_layer(0, &spec, &sources)?;
    let map = store.slot_map(0)?;
    for (e, (w, s)) in experts.iter().enumerate() {
        for (kind, pieces) in [(Kind::Weights, w), (Kind::Scales, s)] {
            let slot = match kind {
                Kind::Weights => store.weights(0, e)?,
                Kind::Scales => store.scales(0, e)?,
            };
            let places = map.pieces(e, kind).unwrap_or(&[]);
            assert_eq!(places.len(), pieces.len(), "{what}: expert {e} {kind:?}");
            let mut covered = vec![false; slot.len()];
            for (p, (off, len)) in places.iter().zip(pieces) {
                assert_eq!(p.len, *len, "{what}");
                let want = &bytes[*off as usize..*off as usize + *len];
                let got = &slot[p.offset..p.offset + p.len];
                assert!(
                    want == got,
                    "{what}: expert {e} {kind:?} piece at file {off} len {len} slot {} differs \
                     (first diff at {:?})",
                    p.offset,
                    want.iter().zip(got).position(|(a, b)| a != b)
                );
                covered[p.offset..p.end()]
                    .iter_mut()
                    .for_each(|c| *c = true);
            }
            for (i, c) in covered.iter().enumerate() {
                if !c {
                    assert_eq!(slot[i], 0, "{what}: expert {e} {kind:?} padding byte {i}");
                }
            }
        }
    }
    Ok(report)
}

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
            // slot stays at 40 MiB, not 400 (the 4-node VM has 512 MiB per node).
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

/// Drop-behind with experts whose pieces run backwards through the file (expert 0 reads
/// the end, the last expert the start), each piece also read again by its neighbour:
/// the cache must stay near `DROP_BEHIND_EVERY` during the load and empty after it.
#[test]
fn drop_behind_keeps_its_bound_when_slots_read_the_file_backwards() {
    use numapin::store::{DROP_BEHIND_EVERY, ProgressHook};
    let Some(d) = evictable_dir(
        "backwards",
        "drop_behind_keeps_its_bound_when_slots_read_the_file_backwards",
    ) else {
        return;
    };
    let path = d.join("data.bin");
    let chunk = (1usize << 20) + 333;
    let experts = 96usize;
    let len = chunk * experts;
    let bytes = write_file(&path, len, 21);
    let file = open_uncached(&path);
    // Sampled at each progress report of the load.
    let peak = CachePeak::new(&file);
    let sampler = {
        let peak = peak.clone();
        ProgressHook::new(move |_| peak.sample())
    };
    let layout: Vec<_> = (0..experts)
        .map(|e| {
            let at = ((experts - 1 - e) * chunk) as u64;
            (vec![(at, chunk)], vec![])
        })
        .collect();
    let options = StoreOptions::default()
        .huge_pages(false)
        .loader_threads(2)
        .read_mode(ReadMode::DropBehind)
        .progress(Some(sampler));
    pack_and_check(options, &file, &bytes, &layout, "backwards").unwrap();
    let bound = DROP_BEHIND_EVERY as usize + 2 * (2 << 20) + 2 * (2 * chunk);
    peak.assert_bounded("backwards", bound);
}

#[cfg(feature = "model")]
mod common;

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
                            let experts = view.shape()[0] as usize;
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

/// The file system's direct-I/O alignments (memory, offset), if it reports them.
fn dio_align(file: &File) -> Option<(u64, u64)> {
    let s = rustix::fs::statx(
        file,
        c"",
        rustix::fs::AtFlags::EMPTY_PATH,
        rustix::fs::StatxFlags::DIOALIGN,
    )
    .ok()?;
    (s.stx_mask & rustix::fs::StatxFlags::DIOALIGN.bits() != 0 && s.stx_dio_offset_align > 0)
        .then_some((s.stx_dio_mem_align as u64, s.stx_dio_offset_align as u64))
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
    let Some((mem, unit)) = dio_align(&file) else {
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

/// `expert_cache` writing into a pipe already closed (`expert_cache | true`): the program
/// ends with status 141 as `SIGPIPE` would end it, not a panic in `println!`. The example
/// binary is the one `cargo test` builds beside this test's (`target/<profile>/examples`).
#[test]
fn expert_cache_into_a_closed_pipe_ends_with_141() {
    let exe = std::env::current_exe().unwrap();
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .join("examples")
        .join("expert_cache");
    // Every example prints through `outln!`: no `print!`/`println!` to stdout anywhere.
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    if !examples.is_dir() {
        println!(
            "NOT RUN: expert_cache_into_a_closed_pipe_ends_with_141 reads the examples' sources, not at {} here (the VM)",
            examples.display()
        );
        return;
    }
    for entry in std::fs::read_dir(&examples).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path).unwrap();
            for (i, line) in text.lines().enumerate() {
                let code = line.split("//").next().unwrap_or("");
                assert!(
                    !code.contains("println!(") || code.contains("eprintln!("),
                    "{}:{}: println! panics on a closed pipe; use support::outln!",
                    path.display(),
                    i + 1
                );
                assert!(
                    !code.contains(" print!(") && !code.starts_with("print!("),
                    "{}:{}: print! to stdout",
                    path.display(),
                    i + 1
                );
            }
        }
    }
    let source = examples.join("expert_cache.rs");
    let fresh = |bin: &Path| {
        let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        matches!((modified(bin), modified(&source)), (Some(b), Some(s)) if b >= s)
    };
    if !fresh(&bin) {
        println!(
            "NOT RUN (the run; the source check above ran): {} is missing or older than its \
             source (`cargo test` builds it; `--test hostile5` alone does not)",
            bin.display()
        );
        return;
    }
    let mut child = std::process::Command::new(&bin)
        .args([
            "--ops",
            "1000",
            "--slots",
            "4",
            "--layers",
            "2",
            "--experts",
            "8",
        ])
        .args(["--weight-bytes", "4096"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(141), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
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

/// Drop-behind over many tiny pieces spread thinly over a large file: few bytes are read,
/// but each read brings the kernel's readahead with it. The cache, sampled by a thread of
/// the test's own during the load, must stay near `DROP_BEHIND_EVERY` as promised, not
/// grow with the span of the file read over.
#[test]
fn drop_behind_over_sparse_tiny_pieces_keeps_its_bound() {
    use numapin::store::DROP_BEHIND_EVERY;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let Some(d) = evictable_dir(
        "sparse",
        "drop_behind_over_sparse_tiny_pieces_keeps_its_bound",
    ) else {
        return;
    };
    let path = d.join("data.bin");
    let len = 128usize << 20;
    {
        let mut f = File::create(&path).unwrap();
        let block: Vec<u8> = (0..1 << 20)
            .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
            .collect();
        for _ in 0..len >> 20 {
            f.write_all(&block).unwrap();
        }
        f.sync_all().unwrap();
    }
    let bytes = std::fs::read(&path).unwrap();
    let file = open_uncached(&path);
    // Experts of 64 pieces of 64 bytes, one every STRIDE bytes: 64 B read per STRIDE.
    const STRIDE: u64 = 8 << 10;
    let experts: Vec<Pieces> = (0..(len as u64 / STRIDE / 64))
        .map(|e| {
            (
                (0..64u64)
                    .map(|p| ((e * 64 + p) * STRIDE + 100, 64))
                    .collect(),
                vec![],
            )
        })
        .collect();
    // Sampled by a thread of the test's own every 2 ms: one layer of tiny pieces makes
    // few progress reports.
    let (done, peak) = (Arc::new(AtomicBool::new(false)), CachePeak::new(&file));
    let sampler = {
        let (done, peak) = (done.clone(), peak.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::SeqCst) {
                peak.sample();
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
        })
    };
    let options = StoreOptions::default()
        .huge_pages(false)
        .loader_threads(2)
        .read_mode(ReadMode::DropBehind);
    let result = pack_and_check(options, &file, &bytes, &experts, "sparse");
    done.store(true, Ordering::SeqCst);
    sampler.join().unwrap();
    result.unwrap();
    peak.assert_bounded("sparse", DROP_BEHIND_EVERY as usize + 2 * (2 << 20));
}

/// `dir(name)` where evicting a file from the page cache works; `None` (after saying
/// NOT RUN for `test`) where it cannot.
fn evictable_dir(name: &str, test: &str) -> Option<PathBuf> {
    let d = dir(name);
    if !evicts_here(&d) {
        println!(
            "NOT RUN: {test} needs a file system whose page cache can be evicted; {} keeps its files in memory (the VM's initramfs)",
            d.display()
        );
        return None;
    }
    Some(d)
}

/// `path` opened with no kernel readahead (as tests/read_modes) and evicted: what stays
/// cached during a load is drop-behind's doing.
fn open_uncached(path: &Path) -> File {
    let file = File::open(path).unwrap();
    rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::Random).unwrap();
    numapin_testkit::cache::evict(&file).unwrap();
    file
}

/// The most pages of a file seen cached by [`CachePeak::sample`], from any thread.
#[derive(Clone)]
struct CachePeak {
    file: std::sync::Arc<File>,
    peak: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl CachePeak {
    fn new(file: &File) -> CachePeak {
        CachePeak {
            file: std::sync::Arc::new(file.try_clone().unwrap()),
            peak: Default::default(),
        }
    }

    /// Counts the file's cached pages now.
    fn sample(&self) {
        let (resident, _) = numapin_testkit::cache::cached_pages(&self.file).unwrap();
        self.peak
            .fetch_max(resident, std::sync::atomic::Ordering::SeqCst);
    }

    /// After the load: at most 1 in 50 pages still cached, and never more than `bound`
    /// bytes of pages cached during it.
    fn assert_bounded(&self, what: &str, bound: usize) {
        let (after, total) = numapin_testkit::cache::cached_pages(&self.file).unwrap();
        let peak = self.peak.load(std::sync::atomic::Ordering::SeqCst);
        let bound = bound / numapin::page_size();
        println!("{what}: {after} of {total} pages cached after, {peak} at most during");
        assert!(
            after * 50 <= total,
            "{what}: {after} of {total} cached after the load"
        );
        assert!(
            peak <= bound,
            "{what}: {peak} pages cached during the load, more than {bound} (total {total})"
        );
    }
}

/// Whether evicting a file of `dir` from the page cache works here: false on ramfs and
/// tmpfs, whose page cache is the file itself (the VM's initramfs).
fn evicts_here(dir: &Path) -> bool {
    use numapin_testkit::cache::{cached_pages, evict};
    let probe = dir.join("evict-probe.bin");
    std::fs::write(&probe, vec![1u8; 64 << 10]).unwrap();
    let file = std::fs::File::open(&probe).unwrap();
    let evicted =
        evict(&file).is_ok() && cached_pages(&file).is_ok_and(|(resident, _)| resident == 0);
    let _ = std::fs::remove_file(&probe);
    evicted
}
