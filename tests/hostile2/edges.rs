//! Hostile sizes and files for the store, the cache and the manifest: direct reads of a
//! short file, alignments at the edge of `usize`, cache and staging sizes at the edge,
//! manifests of garbage, `attach` with the files out of order. Each probe runs in a child
//! under its full test path (`edges::…`).

use super::*;

// ---------------------------------------------------------------------------------------
// PinStore: direct reads of a short file, alignments at the edge

/// A file shorter than the pieces claim, in every read mode: an error naming the offset.
#[test]
fn store_pack_of_a_short_file_names_the_offset() {
    const NAME: &str = "edges::store_pack_of_a_short_file_names_the_offset";
    if !child(NAME) {
        return;
    }
    let dir = scratch(NAME);
    let path = dir.join("weights.bin");
    std::fs::write(&path, vec![7u8; 3 * 8192]).unwrap();
    let file = File::open(&path).unwrap();
    for mode in MODES {
        // Expert 1 reads 8192..(8192 + 20000): past the end at 24576.
        let sources = [
            ExpertSource::File {
                weights: vec![Piece::new(&file, 0, 8192)],
                scales: vec![],
            },
            ExpertSource::File {
                weights: vec![Piece::new(&file, 8192, 20000)],
                scales: vec![],
            },
        ];
        let spec = LayerSpec::fitting(&sources).unwrap();
        let err = store(mode).pack_layer(0, &spec, &sources).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("8192"), "{mode:?}: {text}");
        println!("{mode:?}: {text}");
    }
}

fn pack_with(options: StoreOptions) -> numapin::Result<()> {
    let (w, s) = (vec![1u8; 5000], vec![2u8; 100]);
    let sources = [ExpertSource::Memory {
        weights: &w,
        scales: &s,
    }];
    let spec = LayerSpec::fitting(&sources)?;
    let store = PinStore::new(Layout::Unplaced, options)?;
    store.pack_layer(0, &spec, &sources)?;
    assert_eq!(store.weights(0, 0)?, &w[..]);
    Ok(())
}

#[test]
fn store_piece_align_edges() {
    const NAME: &str = "edges::store_piece_align_edges";
    if !child(NAME) {
        return;
    }
    for align in [
        0,
        1,
        2,
        3,
        usize::MAX / 2,
        usize::MAX / 2 + 1,
        1 << 40,
        usize::MAX,
    ] {
        let result = pack_with(StoreOptions::default().piece_align(align));
        println!("piece_align {align}: {result:?}");
        if align == 1 || align == 2 {
            result.unwrap();
        } else if !align.is_power_of_two() || align > numapin::store::MAX_ALIGN {
            assert!(
                matches!(result, Err(Error::InvalidArgument { .. })),
                "{align}: {result:?}"
            );
        }
    }
}

/// Pieces of files with a huge `piece_align`: two pieces at multiples of 2^40 (or 2^62)
/// would need a slot of terabytes; the store must refuse, not try to populate it.
#[test]
fn store_piece_align_huge_with_file_pieces() {
    const NAME: &str = "edges::store_piece_align_huge_with_file_pieces";
    if !child(NAME) {
        return;
    }
    let dir = scratch(NAME);
    let path = dir.join("w.bin");
    std::fs::write(&path, vec![9u8; 8192]).unwrap();
    let file = File::open(&path).unwrap();
    std::thread::spawn(|| {
        std::thread::sleep(std::time::Duration::from_secs(60));
        let _ = writeln!(
            std::io::stderr(),
            "HANG: pack_layer with a huge piece_align"
        );
        std::process::exit(3);
    });
    for align in [1usize << 40, 1 << 62, usize::MAX / 2 + 1] {
        let sources = [ExpertSource::File {
            weights: vec![
                Piece::new(&file, 0, 100),
                Piece::new(&file, 4096, 100),
                Piece::new(&file, 200, 100),
            ],
            scales: vec![],
        }];
        let result = (|| {
            let spec = LayerSpec::fitting(&sources)?;
            let store =
                PinStore::new(Layout::Unplaced, StoreOptions::default().piece_align(align))?;
            store.pack_layer(0, &spec, &sources)?;
            Ok::<_, Error>(store.weights(0, 0)?.len())
        })();
        println!("piece_align {align}: {result:?}");
        assert!(
            matches!(result, Err(Error::InvalidArgument { .. })),
            "{align}: {result:?}"
        );
    }
}

#[test]
fn store_slot_align_edges() {
    const NAME: &str = "edges::store_slot_align_edges";
    if !child(NAME) {
        return;
    }
    for align in [
        SlotAlign::Bytes(usize::MAX / 2 + 1),
        SlotAlign::Bytes(1 << 40),
        SlotAlign::Bytes(0),
        SlotAlign::Bytes(usize::MAX),
        SlotAlign::Bytes(4096 * 3),
    ] {
        let result = pack_with(StoreOptions::default().slot_align(align));
        println!("{align:?}: {result:?}");
        // Refused before any mapping: not a power of two, or beyond MAX_ALIGN (1 GiB).
        assert!(
            matches!(result, Err(Error::InvalidArgument { .. })),
            "{align:?}: {result:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// ExpertCache and StagingPool sizes

fn node0() -> NodeSet {
    common::nodes().iter().take(1).collect()
}

#[test]
fn cache_sizes_at_the_edge() {
    const NAME: &str = "edges::cache_sizes_at_the_edge";
    if !child(NAME) {
        return;
    }
    let opts = CacheOptions::default();
    let cases: [(NodeSet, usize, usize, usize); 7] = [
        (node0(), usize::MAX, 4096, 0),
        (node0(), 1, usize::MAX, 0),
        (node0(), 1, 4096, usize::MAX),
        (NodeSet::new(), 1, 4096, 0),
        (node0(), u32::MAX as usize - 2, 1, 0),
        (node0(), 1 << 31, 1, 1),
        (node0(), 1, 1 << 50, 0),
    ];
    for (nodes, slots, w, s) in cases {
        let result = ExpertCache::new(nodes, slots, w, s, opts);
        println!(
            "{nodes} slots={slots} w={w} s={s}: {:?}",
            result.as_ref().map(|c| c.slots_per_node())
        );
        assert!(result.is_err(), "{slots} {w} {s}");
    }
}

#[test]
fn cache_on_a_node_not_allowed() {
    const NAME: &str = "edges::cache_on_a_node_not_allowed";
    if !child(NAME) {
        return;
    }
    let allowed = common::nodes();
    let other = (0..numapin::MAX_NODES as u16)
        .map(numapin::Node)
        .find(|n| !allowed.contains(*n))
        .unwrap();
    let mut set = NodeSet::new();
    set.insert(other);
    let result = ExpertCache::new(set, 2, 4096, 0, CacheOptions::default());
    let Err(err) = result else {
        panic!("a cache on node {other}, which is not allowed");
    };
    println!("{other}: {err}");
    // A node that is not possible here is an invalid argument naming it; one that exists
    // but is outside the cpuset is NodeNotAllowed.
    let names_it = matches!(err, Error::NodeNotAllowed { .. })
        || (matches!(err, Error::InvalidArgument { .. })
            && err.to_string().contains(&format!("node {other} ")));
    assert!(names_it, "{err:?}");
}

#[test]
fn cache_get_or_load_from_a_truncated_file() {
    const NAME: &str = "edges::cache_get_or_load_from_a_truncated_file";
    if !child(NAME) {
        return;
    }
    let dir = scratch(NAME);
    let path = dir.join("w.bin");
    std::fs::write(&path, vec![5u8; 8192]).unwrap();
    let file = File::open(&path).unwrap();
    let cache = ExpertCache::new(node0(), 2, 8192, 0, CacheOptions::default()).unwrap();
    let node = node0().iter().next().unwrap();
    File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(100)
        .unwrap();
    let source = ExpertSource::File {
        weights: vec![Piece::new(&file, 0, 8192)],
        scales: vec![],
    };
    let Err(err) = cache.get_or_load(0, 0, &source, Some(node)) else {
        panic!("a load from a truncated file succeeded");
    };
    println!("{err}");
    assert!(cache.get(0, 0).is_none());
    let stats = cache.stats().unwrap();
    assert_eq!((stats.loads, stats.load_failures), (0, 1));
    // The slot went back: both slots still load.
    let good = vec![1u8; 8192];
    let memory = ExpertSource::Memory {
        weights: &good,
        scales: &[],
    };
    let a = cache.get_or_load(0, 1, &memory, Some(node)).unwrap();
    let b = cache.get_or_load(0, 2, &memory, Some(node)).unwrap();
    assert_eq!((a.weights(), b.weights()), (&good[..], &good[..]));
}

#[test]
fn staging_pool_sizes_at_the_edge() {
    const NAME: &str = "edges::staging_pool_sizes_at_the_edge";
    if !child(NAME) {
        return;
    }
    for (buffers, bytes) in [
        (0, 4096),
        (4, 0),
        (usize::MAX, 4096),
        (4096, usize::MAX),
        (1 << 35, 1),
        (1 << 40, 1),
    ] {
        let result = StagingPool::new(buffers, bytes);
        println!(
            "{buffers} x {bytes}: {:?}",
            result.as_ref().map(|p| p.span())
        );
        assert!(result.is_err(), "{buffers} x {bytes}");
    }
}

// ---------------------------------------------------------------------------------------
// Manifest

#[test]
fn manifest_garbage_long_lines_and_crlf() {
    const NAME: &str = "edges::manifest_garbage_long_lines_and_crlf";
    if !child(NAME) {
        return;
    }
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let garbage: String = (0..10 << 20)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            char::from(b' ' + (state % 95) as u8)
        })
        .collect();
    let header = "numapin-store 2";
    let long = format!("{header}\nregion {}\n", "x".repeat(10 << 20));
    let many = format!("{header}\n{}", "\n".repeat(1 << 20));
    let valid = format!(
        "{header}\nregion layer=0 kind=weights len=8192 stride=4096 slot_bytes=100 slots=1 loaded=100\n"
    );
    Manifest::parse(&valid).unwrap();
    let big_slots = format!(
        "{header}\nregion layer=0 kind=weights len=0 stride=0 slot_bytes=0 slots={} loaded=\n",
        usize::MAX
    );
    let crlf = format!(
        "{header}\r\nregion layer=0 kind=weights len=8192 stride=4096 slot_bytes=100 slots=1 loaded=100\r\n"
    );
    let commas = format!(
        "{header}\nregion layer=0 kind=weights len=8192 stride=4096 slot_bytes=100 slots=1 loaded={}\n",
        ",".repeat(5 << 20)
    );
    for (what, text) in [
        ("garbage", garbage.clone()),
        ("garbage\\n", format!("{garbage}\n")),
        ("long line", long),
        ("empty lines", many),
        ("slots=usize::MAX", big_slots),
        ("crlf", crlf),
        ("commas", commas),
    ] {
        // Past the header: every case but the first two reaches a region line.
        assert!(
            text.starts_with(header) || what.starts_with("garbage"),
            "{what}"
        );
        let err = Manifest::parse(&text).unwrap_err();
        let msg = err.to_string();
        if what.starts_with("garbage") || what == "crlf" {
            assert!(
                msg.contains("line 0") || msg.contains("line 1"),
                "{what}: {msg}"
            );
        } else {
            assert!(msg.contains("line 2"), "{what}: {msg}");
        }
        assert!(msg.len() < 2000, "{what}: a {} byte message", msg.len());
        println!("{what}: {msg}");
    }
}

// ---------------------------------------------------------------------------------------
// PinStore::attach with the files out of the manifest's order

/// Two layers of the same shape exported, attached with the files swapped: the regions
/// have equal lengths, so only the memfds' names tell them apart. The attach must refuse,
/// not serve layer 1's bytes as layer 0's.
#[test]
fn attach_with_files_out_of_order() {
    const NAME: &str = "edges::attach_with_files_out_of_order";
    if !child(NAME) {
        return;
    }
    let mut store = PinStore::new(Layout::Unplaced, StoreOptions::default().shared(true)).unwrap();
    let (w0, w1) = (vec![10u8; 5000], vec![11u8; 5000]);
    for (layer, w) in [(0, &w0), (1, &w1)] {
        let sources = [ExpertSource::Memory {
            weights: w,
            scales: &[],
        }];
        let spec = LayerSpec::fitting(&sources).unwrap();
        store.pack_layer(layer, &spec, &sources).unwrap();
    }
    let export = store.export().unwrap();
    assert_eq!(export.files.len(), 2);
    // In order: each layer its own bytes.
    let clone = |f: &File| f.try_clone().unwrap();
    let attached =
        PinStore::attach(&export.manifest, export.files.iter().map(clone).collect()).unwrap();
    assert_eq!(attached.weights(0, 0).unwrap(), &w0[..]);
    assert_eq!(attached.weights(1, 0).unwrap(), &w1[..]);
    // Swapped.
    let swapped: Vec<File> = export.files.iter().rev().map(clone).collect();
    let result = PinStore::attach(&export.manifest, swapped);
    match &result {
        Ok(s) => panic!(
            "attached with the files swapped: layer 0 expert 0 reads {:?}…",
            &s.weights(0, 0).unwrap()[..4]
        ),
        Err(e) => {
            println!("{e}");
            // Typed: the file for layer 0 weights, which is layer 1's memfd.
            assert!(
                matches!(
                    e,
                    Error::InvalidArgument {
                        reason: numapin::Invalid::BadValue { what: "file", value, why },
                        ..
                    } if value.contains("layer 0") && why.contains("numapin-layer1")
                ),
                "{e:?}"
            );
        }
    }
}
