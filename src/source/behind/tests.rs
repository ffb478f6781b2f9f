//! The drop-behind records' advice, range by range.

use super::*;
use std::path::Path;

const MIB: u64 = 1 << 20;

// The steps below count in 2 MiB advices.
const _: () = assert!(DROP_BEHIND_EVERY == 2 * MIB && FOLIO_MAX == 2 * MIB);

#[test]
fn a_stalled_loader_keeps_only_its_own_range_cached() {
    let s = Stream::new([(0, 64 * MIB)]);
    // One loader is on [0, 1 MiB) for a long time; the other reads on.
    assert_eq!(s.after_read(MIB, 4 * MIB), vec![(MIB, 4 * MIB)]);
    // The stalled range finishes: it goes at the next advice, widened by a folio
    // on each side (clipped at nothing unread), with the next stretch.
    assert_eq!(s.after_read(0, MIB), vec![]);
    assert_eq!(
        s.after_read(4 * MIB, 7 * MIB),
        vec![(0, 3 * MIB), (4 * MIB, 7 * MIB)]
    );
    // The next advice starts again at the folio the last one ended in.
    assert_eq!(s.after_read(7 * MIB, 9 * MIB), vec![(6 * MIB, 9 * MIB)]);
}

#[test]
fn nothing_a_loader_still_has_to_read_is_advised() {
    let s = Stream::new([(0, 64 * MIB)]);
    // Read out of order: [8, 9) and [30, 40) MiB read, the rest not.
    assert_eq!(s.after_read(8 * MIB, 9 * MIB), vec![]);
    assert_eq!(
        s.after_read(30 * MIB, 40 * MIB),
        vec![(8 * MIB, 9 * MIB), (30 * MIB, 40 * MIB)]
    );
    // The gaps, read late, go widened, but not into what is still unread.
    assert_eq!(s.after_read(0, 8 * MIB), vec![(0, 9 * MIB)]);
    assert_eq!(s.after_read(9 * MIB, 30 * MIB), vec![(7 * MIB, 32 * MIB)]);
    // Everything read: the rest of what was announced goes, and nothing past it
    // (the kernel's readahead for the next fill).
    assert_eq!(s.after_read(40 * MIB, 64 * MIB), vec![(40 * MIB, 64 * MIB)]);
    assert_eq!(s.end(), 64 * MIB);
}

#[test]
fn gaps_between_the_ranges_read_are_advised_with_them() {
    let s = Stream::new([(10 * MIB, 4 * MIB), (0, 4 * MIB), (40 * MIB, 30 * MIB)]);
    assert_eq!(s.after_read(0, MIB), vec![]);
    assert_eq!(s.after_read(MIB, 4 * MIB), vec![(0, 4 * MIB)]);
    assert_eq!(s.after_read(10 * MIB, 14 * MIB), vec![(4 * MIB, 14 * MIB)]);
}

#[test]
fn empty_and_overflowing_ranges_are_harmless() {
    let s = Stream::new([(u64::MAX - 5, 100), (7, 0)]);
    assert_eq!(
        s.after_read(u64::MAX - 5, u64::MAX),
        vec![(u64::MAX - 5, u64::MAX)]
    );
    // Nothing announced: the first read lets itself go, and a read after that lets
    // its own pages go again.
    let none = Stream::new([]);
    assert_eq!(none.after_read(0, 10), vec![(0, 10)]);
    assert_eq!(none.after_read(0, 10), vec![(0, 10 + FOLIO_MAX)]);
    assert_eq!(none.end(), 10);
}

#[test]
fn a_shared_record_keeps_what_a_later_fill_reads_and_what_lies_past_it() {
    // A placement: a dense fill reads [0, 1) and [20, 24) MiB, the experts' fill
    // [1, 20) MiB, then a second layer's dense fill [24, 40) MiB.
    let s = Stream::shared([
        (0, MIB),
        (20 * MIB, 4 * MIB),
        (MIB, 19 * MIB),
        (24 * MIB, 16 * MIB),
    ]);
    s.begin([(0, MIB), (20 * MIB, 4 * MIB)]);
    assert_eq!(s.after_read(0, MIB), vec![]);
    // Nothing at or past the experts' first byte goes: the kernel's readahead from
    // their reads runs over [20, 24), which must still be cached then. The end of the
    // fill advises the folio the mark fell in again.
    assert_eq!(s.after_read(20 * MIB, 24 * MIB), vec![(0, MIB)]);
    assert_eq!(s.flush(), vec![(0, MIB)]);
    // The experts' fill: up to the next fill's first byte, but what it still reads.
    s.begin([(MIB, 19 * MIB)]);
    assert_eq!(
        s.after_read(MIB, 4 * MIB),
        vec![(0, 4 * MIB), (20 * MIB, 24 * MIB)]
    );
    // Read behind that mark: it goes, widened by a folio each side.
    assert_eq!(s.after_read(4 * MIB, 20 * MIB), vec![(2 * MIB, 22 * MIB)]);
    // The last fill: everything read, up to the end of what was announced.
    s.begin([(24 * MIB, 16 * MIB)]);
    assert_eq!(s.after_read(24 * MIB, 40 * MIB), vec![(24 * MIB, 40 * MIB)]);
    assert_eq!(s.flush(), vec![]);
    // A record for one fill is not limited by any other.
    let own = Stream::new([(0, 8 * MIB)]);
    assert_eq!(own.after_read(2 * MIB, 5 * MIB), vec![(2 * MIB, 5 * MIB)]);
}

#[test]
fn the_furthest_end_is_kept_per_file_not_per_descriptor() {
    let dir = std::env::temp_dir().join(format!("numapin-advised-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (a, b) = (dir.join("a"), dir.join("b"));
    std::fs::write(&a, b"a").unwrap();
    std::fs::write(&b, b"b").unwrap();
    let advised = Advised::default();
    let (a1, a2, b1) = (
        File::open(&a).unwrap(),
        File::open(&a).unwrap(),
        File::open(&b).unwrap(),
    );
    // Backwards through `a`: the later, lower ends reach the first one's.
    assert_eq!(advised.reach(&a1, 64 * MIB), 64 * MIB);
    assert_eq!(advised.reach(&a2, 60 * MIB), 64 * MIB);
    // Forwards: each end its own.
    assert_eq!(advised.reach(&a1, 68 * MIB), 68 * MIB);
    // Another file keeps its own.
    assert_eq!(advised.reach(&b1, 4 * MIB), 4 * MIB);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn what_readahead_from_an_unread_range_reaches_is_held_until_it_is_read() {
    // Merged experts, one loader: gate pieces [0, 24) MiB, up pieces [24, 48) MiB,
    // read side by side (gate 0, up 0, gate 1, up 1, ...), 3 MiB each; readahead
    // reaches 10 MiB past a read.
    let s = Stream::new([(0, 48 * MIB)]).with_reach(10 * MIB);
    assert_eq!(s.after_read(0, 3 * MIB), vec![(0, 3 * MIB)]);
    // Up 0 is within 10 MiB of gate 1..7's end (24 MiB): held, not advised (the
    // folio below the last mark goes again).
    assert_eq!(s.after_read(24 * MIB, 27 * MIB), vec![(2 * MIB, 3 * MIB)]);
    let mut advised = Vec::new();
    for k in 1..7 {
        advised.extend(s.after_read(3 * k * MIB, 3 * (k + 1) * MIB));
        advised.extend(s.after_read((24 + 3 * k) * MIB, (27 + 3 * k) * MIB));
    }
    // Gate pieces go as read (the unread ones above them are not below them); of the
    // up pieces only what lies 10 MiB past gate 7's end or further.
    assert!(covers(&advised, 3 * MIB, 21 * MIB), "{advised:?}");
    assert!(covers(&advised, 34 * MIB, 45 * MIB), "{advised:?}");
    assert!(
        !advised.iter().any(|&(a, b)| a < 34 * MIB && b > 24 * MIB),
        "{advised:?}"
    );
    // Gate 7 read: nothing is unread below the held up pieces any more.
    let last = s.after_read(21 * MIB, 24 * MIB);
    assert!(covers(&last, 24 * MIB, 34 * MIB), "{last:?}");
    assert!(covers(
        &s.after_read(45 * MIB, 48 * MIB),
        45 * MIB,
        48 * MIB
    ));
}

/// Whether the ranges together cover `[lo, hi)`.
fn covers(ranges: &[(u64, u64)], lo: u64, hi: u64) -> bool {
    let mut sorted = ranges.to_vec();
    sorted.sort_unstable();
    let mut at = lo;
    for (a, b) in sorted {
        if a <= at {
            at = at.max(b);
        }
    }
    at >= hi
}

#[test]
fn no_reach_advises_as_before_and_a_huge_one_holds_without_overflow() {
    let plain = Stream::new([(0, 8 * MIB), (16 * MIB, 8 * MIB)]);
    // The gap between the ranges goes with what was read.
    assert_eq!(
        plain.after_read(16 * MIB, 19 * MIB),
        vec![(8 * MIB, 19 * MIB)]
    );
    let huge = Stream::new([(0, 8 * MIB), (16 * MIB, 8 * MIB)]).with_reach(u64::MAX);
    assert_eq!(huge.after_read(16 * MIB, 19 * MIB), vec![]);
    // All read: everything goes, held or not.
    let all = huge.after_read(0, 8 * MIB);
    assert!(covers(&all, 8 * MIB, 19 * MIB), "{all:?}");
}

#[test]
fn the_reach_is_twice_the_devices_readahead_and_a_folio() {
    let file = File::open(std::env::current_exe().unwrap()).unwrap();
    let reach = readahead_reach(&file);
    // Whatever the device: at least twice the kernel's smallest sensible window
    // (4 KiB) and a folio, a multiple of 2 KiB, and not absurd.
    assert!(reach >= 2 * 4096 + FOLIO_MAX, "{reach}");
    assert_eq!(reach % 2048, 0, "{reach}");
    assert!(reach < (1 << 40), "{reach}");
}

#[test]
fn range_sets_split_and_complement_exactly() {
    let mut set: BTreeMap<u64, u64> = [(0, 10), (20, 30)].into_iter().collect();
    assert_eq!(outside(&set, (5, 35)), vec![(10, 20), (30, 35)]);
    assert_eq!(outside(&set, (0, 10)), vec![]);
    remove(&mut set, 5, 25);
    assert_eq!(set.into_iter().collect::<Vec<_>>(), vec![(0, 5), (25, 30)]);
}

/// Replays `reads` (offset, end) through `s`: the most bytes read and not advised yet at
/// once, what is left so at the end ([`Stream::flush`]), and the ranges advised.
fn replay(s: &Stream, reads: &[(u64, u64)]) -> (u64, u64, usize) {
    // The bytes of `[a, b)` in `set`, taken out of it.
    fn take(set: &mut BTreeMap<u64, u64>, a: u64, b: u64) -> u64 {
        let inside: u64 = set
            .range(..b)
            .rev()
            .take_while(|&(_, &e)| e > a)
            .map(|(&s, &e)| e.min(b) - s.max(a))
            .sum();
        remove(set, a, b);
        inside
    }
    let mut cached: BTreeMap<u64, u64> = BTreeMap::new();
    let (mut total, mut peak, mut advised) = (0, 0, 0);
    for &(a, b) in reads {
        total -= take(&mut cached, a, b);
        cached.insert(a, b);
        total += b - a;
        let advice = s.after_read(a, b);
        advised += advice.len();
        for (x, y) in advice {
            total -= take(&mut cached, x, y);
        }
        peak = peak.max(total);
    }
    let advice = s.flush();
    advised += advice.len();
    for (x, y) in advice {
        total -= take(&mut cached, x, y);
    }
    assert_eq!(total, cached.iter().map(|(a, b)| b - a).sum::<u64>());
    (peak, total, advised)
}

#[test]
fn what_the_guard_holds_is_capped_whatever_the_read_order() {
    // 256 pieces of 4 MiB, the even ones read first (a slot order that is not the file's:
    // every odd piece is unread below an even one read). Readahead reaches 18 MiB (an
    // 8 MiB read_ahead_kb): uncapped, every even piece was held until the odd ones were
    // read, half the file (508 MiB) cached at once.
    let reach = 18 * MIB;
    let pieces: Vec<(u64, u64)> = (0..256).map(|i| (i * 4 * MIB, 4 * MIB)).collect();
    let reads: Vec<(u64, u64)> = (0..256)
        .step_by(2)
        .chain((1..256).step_by(2))
        .map(|i| (pieces[i].0, pieces[i].0 + pieces[i].1))
        .collect();
    for shared in [false, true] {
        let s = if shared {
            let s = Stream::shared(pieces.iter().copied());
            s.begin(pieces.iter().copied());
            s
        } else {
            Stream::new(pieces.iter().copied())
        }
        .with_reach(reach);
        let (peak, left, _) = replay(&s, &reads);
        // The held bytes, the read since the last advice and the folio it restarts at.
        assert!(
            peak <= HELD_REACHES * reach + DROP_BEHIND_EVERY + 4 * MIB + FOLIO_MAX,
            "shared {shared}: {} MiB read and not advised at once",
            peak / MIB
        );
        // The guard still holds up to its cap.
        assert!(peak >= (HELD_REACHES - 1) * reach, "{}", peak / MIB);
        assert_eq!(left, 0, "shared {shared}");
    }
    // The designed case (merged experts, gate, up and down regions read side by side)
    // holds what it held before: the parts of the up and down regions the readahead from
    // the gate and up pieces still to be read reaches.
    let pieces: Vec<(u64, u64)> = (0..384).map(|i| (i * MIB, MIB)).collect();
    let reads: Vec<(u64, u64)> = (0..128)
        .flat_map(|e| [e, 128 + e, 256 + e])
        .map(|i| (i as u64 * MIB, (i as u64 + 1) * MIB))
        .collect();
    let s = Stream::new(pieces.iter().copied()).with_reach(reach);
    let (peak, left, _) = replay(&s, &reads);
    assert!(
        peak >= 2 * reach && peak <= 2 * reach + 3 * MIB,
        "{}",
        peak / MIB
    );
    assert_eq!(left, 0);
}

#[test]
fn late_reads_are_advised_once_not_once_per_neighbour() {
    // 100,000 pieces of 100 bytes, the even ones read first: the odd ones are then read
    // below the cursor, each widened by a folio each side. Each window was complemented
    // against what is unread on its own: 110 million ranges (as many `posix_fadvise`
    // calls) where the windows of one advice overlap.
    let pieces: Vec<(u64, u64)> = (0..100_000).map(|i| (i * 100, 100)).collect();
    let reads: Vec<(u64, u64)> = (0..100_000)
        .step_by(2)
        .chain((1..100_000).step_by(2))
        .map(|i| (pieces[i].0, pieces[i].0 + 100))
        .collect();
    for reach in [0, 18 * MIB] {
        let s = Stream::new(pieces.iter().copied()).with_reach(reach);
        let (_, left, advised) = replay(&s, &reads);
        assert_eq!(left, 0, "reach {reach}");
        assert!(
            advised <= 2 * pieces.len(),
            "reach {reach}: {advised} ranges advised"
        );
    }
}

#[test]
fn a_shared_record_dropped_before_everything_was_read_lets_go_of_what_it_held() {
    // A placement that fails or is cancelled: the pieces read above a piece no fill will
    // read now were held for the readahead from it, and nothing would advise them again.
    let dir = std::env::temp_dir().join(format!("numapin-held-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("f");
    std::fs::write(&path, vec![7u8; (48 * MIB) as usize]).unwrap();
    let file = File::open(&path).unwrap();
    if !numapin_testkit::cache::evictable(&file) {
        println!(
            "NOT RUN: {} cannot drop its page cache (tmpfs)",
            dir.display()
        );
        std::fs::remove_dir_all(&dir).unwrap();
        return;
    }
    // No readahead: what is cached is what was read.
    rustix::fs::fadvise(&file, 0, None, Advice::Random).unwrap();
    numapin_testkit::cache::evict(&file).unwrap();
    // Two fills: [0, 48) MiB, then [48, 56) MiB, which never begins (the placement was
    // cancelled during the first: the end of the last fill would let go of what was held).
    let pieces: Vec<(&File, u64, usize)> =
        (0..56).map(|i| (&file, i * MIB, MIB as usize)).collect();
    let shared = Shared::new(pieces.iter().copied());
    let stream = shared.stream(&file).unwrap();
    stream.begin(pieces[..48].iter().map(|&(_, o, l)| (o, l as u64)));
    // [0, 8) MiB is never read; [8, 48) is read, and advised as the record says.
    let mut buf = vec![0u8; MIB as usize];
    for i in 8..48 {
        use std::os::unix::fs::FileExt;
        file.read_exact_at(&mut buf, i * MIB).unwrap();
        for (a, b) in stream.after_read(i * MIB, (i + 1) * MIB) {
            dont_need(&file, a, b - a).unwrap();
        }
    }
    for (a, b) in stream.flush() {
        dont_need(&file, a, b - a).unwrap();
    }
    let held = numapin_testkit::cache::cached_pages(&file).unwrap().0;
    // What the readahead from [0, 8) could reach was held (at least a folio: the reach is
    // twice read_ahead_kb and a folio).
    assert!(
        held as u64 * 4096 >= FOLIO_MAX.min(40 * MIB) / 2,
        "{held} pages held"
    );
    drop(shared);
    let (left, pages) = numapin_testkit::cache::cached_pages(&file).unwrap();
    assert_eq!(
        left, 0,
        "{left} of {pages} pages left cached after the record went"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_partition_is_read_ahead_as_its_disk() {
    // Partitions (sda1, nvme0n1p2: where most file systems live) have no bdi of their
    // own: /sys/class/bdi holds the whole disk's. A loop device with one partition,
    // made here where this runs as root with losetup and partx.
    let Some(loop_dev) = partitioned_loop() else {
        return;
    };
    let name = loop_dev.0.trim_start_matches("/dev/");
    let dev = std::fs::read_to_string(format!("/sys/class/block/{name}p1/dev")).unwrap();
    let (major, minor) = dev.trim().split_once(':').unwrap();
    let (major, minor): (u32, u32) = (major.parse().unwrap(), minor.parse().unwrap());
    // A window no guess would give, set on the disk.
    let queue = format!("/sys/block/{name}/queue/read_ahead_kb");
    let _restore = Restore(queue.clone(), std::fs::read_to_string(&queue).unwrap());
    if let Err(e) = std::fs::write(&queue, "3072") {
        println!("NOT RUN: a_partition_is_read_ahead_as_its_disk: {queue}: {e}");
        return;
    }
    let kb: u64 = std::fs::read_to_string(&queue)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(kb, 3072);
    assert_eq!(device_read_ahead(major, minor), Some(3072 * 1024));
    // The disk itself, as before.
    let disk = std::fs::read_to_string(format!("/sys/block/{name}/dev")).unwrap();
    let (dmaj, dmin) = disk.trim().split_once(':').unwrap();
    assert_eq!(
        device_read_ahead(dmaj.parse().unwrap(), dmin.parse().unwrap()),
        Some(3072 * 1024)
    );
    // No such device: no window.
    assert_eq!(device_read_ahead(0, u32::MAX >> 12), None);
}

/// A loop device over a 16 MiB image with one partition (`/dev/loopNp1`), detached when
/// dropped; `None` (and a NOT RUN line) where that cannot be made.
fn partitioned_loop() -> Option<LoopDev> {
    let not_run = |why: &str| {
        println!("NOT RUN: a_partition_is_read_ahead_as_its_disk: {why}");
        None
    };
    if !rustix::process::geteuid().is_root() {
        return not_run("not root");
    }
    let image = std::env::temp_dir().join(format!("numapin-part-{}.img", std::process::id()));
    let mut bytes = vec![0u8; 16 << 20];
    // An MBR with one Linux partition: sectors 2048 to 2048 + 16384.
    bytes[446 + 4] = 0x83;
    bytes[446 + 8..446 + 12].copy_from_slice(&2048u32.to_le_bytes());
    bytes[446 + 12..446 + 16].copy_from_slice(&16384u32.to_le_bytes());
    bytes[510] = 0x55;
    bytes[511] = 0xAA;
    std::fs::write(&image, &bytes).unwrap();
    let out = std::process::Command::new("losetup")
        .args(["-f", "-P", "--show"])
        .arg(&image)
        .output();
    std::fs::remove_file(&image).unwrap();
    let out = match out {
        Ok(out) if out.status.success() => out,
        Ok(out) => return not_run(&String::from_utf8_lossy(&out.stderr)),
        Err(e) => return not_run(&format!("losetup: {e}")),
    };
    let dev = LoopDev(String::from_utf8_lossy(&out.stdout).trim().to_string());
    let name = dev.0.trim_start_matches("/dev/").to_string();
    let part = format!("/sys/class/block/{name}p1");
    if !Path::new(&part).exists() {
        // The kernel did not scan it (a container's loop devices): ask partx.
        let _ = std::process::Command::new("partx")
            .args(["-a", &dev.0])
            .output();
    }
    if !Path::new(&part).exists() {
        return not_run(&format!("{} has no partition in sysfs", dev.0));
    }
    Some(dev)
}

/// A sysfs file's value, written back when dropped.
struct Restore(String, String);

impl Drop for Restore {
    fn drop(&mut self) {
        let _ = std::fs::write(&self.0, self.1.trim());
    }
}

/// A loop device this test attached.
struct LoopDev(String);

impl Drop for LoopDev {
    fn drop(&mut self) {
        let _ = std::process::Command::new("losetup")
            .args(["-d", &self.0])
            .status();
    }
}

#[test]
fn the_last_fill_of_a_shared_record_lets_go_of_what_it_held() {
    // Two fills: [0, 8) and [16, 24) MiB; the first never reads [0, 1) MiB (announced,
    // not read: a piece another path read), so its reads above stay held.
    let s = Stream::shared([(0, 8 * MIB), (16 * MIB, 8 * MIB)]).with_reach(64 * MIB);
    s.begin([(0, 8 * MIB)]);
    assert_eq!(s.after_read(MIB, 8 * MIB), vec![]);
    assert_eq!(s.flush(), vec![]);
    s.begin([(16 * MIB, 8 * MIB)]);
    assert_eq!(s.after_read(16 * MIB, 24 * MIB), vec![]);
    // The last fill ends: everything read goes, the unread [0, 1) MiB stays.
    let last = s.flush();
    assert!(covers(&last, MIB, 24 * MIB), "{last:?}");
    assert!(!last.iter().any(|&(a, _)| a < MIB), "{last:?}");
}
