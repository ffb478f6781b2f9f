//! Hostile inputs for round 3's surface: fenced regions at the edges of usize, names at
//! the kernel's length limit, descriptors that are not files through every read mode,
//! node ids and flag bits at the edges, migrate_process with odd pids.

use std::fs::File;
use std::os::fd::{FromRawFd, IntoRawFd};

use numapin::policy::{MbindFlags, MemPolicy, ModeFlags};
use numapin::store::{ExpertSource, LayerSpec, Layout, Piece, PinStore, ReadMode, StoreOptions};
use numapin::{Error, MAX_NODES, Node, NodeSet, Region, page_size};

#[test]
fn fenced_regions_at_the_edges_of_usize() {
    let page = page_size();
    for len in [
        0,
        usize::MAX,
        usize::MAX - page,
        usize::MAX - 2 * page,
        usize::MAX / 2,
        1 << 62,
    ] {
        let e = Region::anonymous_fenced(len).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { .. } | Error::Os { .. }),
            "{len}: {e:?}"
        );
    }
    for align in [0, 1, page - 1, page + 1, usize::MAX, 1 << 63, 1 << 62] {
        let e = Region::anonymous_fenced_aligned(page, align).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { .. } | Error::Os { .. }),
            "{align}: {e:?}"
        );
    }
    for len in [1, page - 1, page, page + 1] {
        let mut r = Region::anonymous_fenced_aligned(len, 2 << 20).unwrap();
        assert_eq!(r.as_ptr() as usize % (2 << 20), 0);
        assert_eq!(r.len(), len.next_multiple_of(page));
        r.as_mut_slice().unwrap().fill(7);
        let _ = r.set_name("numapin attack3");
    }
}

#[test]
fn names_at_the_length_limit() {
    let r = Region::anonymous_fenced(1).unwrap();
    assert!(r.set_name(&"x".repeat(79)).is_ok());
    for bad in [
        "x".repeat(80),
        format!("{}é", "x".repeat(77)), // 79 bytes, not ASCII
        format!("{}é", "x".repeat(78)), // 80 bytes
        "\0".to_string(),
        "a\u{7f}".to_string(),
        "\u{1}".repeat(100_000),
        "\u{10ffff}".repeat(100_000),
    ] {
        let e = r.set_name(&bad).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
        assert!(e.to_string().len() < 1200, "{}", e.to_string().len());
    }
    assert!(r.set_name("").is_ok());
}

fn pack_from(file: &File, mode: ReadMode) -> Result<(), Error> {
    let sources = [ExpertSource::File {
        weights: vec![Piece::new(file, 0, 100)],
        scales: vec![Piece::new(file, 100, 10)],
    }];
    let spec = LayerSpec::fitting(&sources).unwrap();
    let store = PinStore::new(Layout::Unplaced, StoreOptions::default().read_mode(mode))?;
    store.pack_layer(0, &spec, &sources).map(|_| ())
}

#[test]
fn descriptors_that_are_not_files_in_every_read_mode() {
    for mode in ReadMode::ALL {
        let (r, w) = std::io::pipe().unwrap();
        let pipe = File::from(std::os::fd::OwnedFd::from(r));
        drop(w);
        let e = pack_from(&pipe, mode).unwrap_err();
        eprintln!("{mode} pipe: {e}");
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let sock = unsafe { File::from_raw_fd(a.into_raw_fd()) };
        let e = pack_from(&sock, mode).unwrap_err();
        eprintln!("{mode} socket: {e}");
        let d = File::open(std::env::temp_dir()).unwrap();
        let e = pack_from(&d, mode).unwrap_err();
        eprintln!("{mode} dir: {e}");
        // /dev/zero reads zeros forever: the pieces are all zero bytes.
        let zero = File::open("/dev/zero").unwrap();
        match pack_from(&zero, mode) {
            Ok(()) => eprintln!("{mode} /dev/zero: ok"),
            Err(e) => eprintln!("{mode} /dev/zero: {e}"),
        }
        let null = File::open("/dev/null").unwrap();
        let e = pack_from(&null, mode).unwrap_err();
        eprintln!("{mode} /dev/null: {e}");
    }
}

#[test]
fn node_ids_and_flag_bits_at_the_edges() {
    let r = Region::anonymous_fenced(page_size()).unwrap();
    for id in [MAX_NODES as u16 - 1, MAX_NODES as u16, u16::MAX] {
        let e = r
            .bind(&MemPolicy::Preferred(Node(id)), MbindFlags::empty())
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{id}: {e:?}");
        let mut set = NodeSet::new();
        set.insert(Node(id));
        let e = r
            .bind(&MemPolicy::Bind(set), MbindFlags::empty())
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{id}: {e:?}");
        let e = numapin::migrate_process(0, &set, &set).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{id}: {e:?}");
    }
    let e = r
        .bind(&MemPolicy::Bind(NodeSet::new()), MbindFlags::empty())
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    let mut zero = NodeSet::new();
    zero.insert(Node(0));
    for bit in 0..32 {
        let flags = MbindFlags::from_bits_retain(1 << bit);
        let _ = r.bind(&MemPolicy::Bind(zero), flags);
        let mf = ModeFlags::from_bits_retain(1 << bit);
        let _ = r.bind_with(&MemPolicy::Bind(zero), mf, MbindFlags::empty());
    }
    let _ = r.bind(&MemPolicy::Bind(zero), MbindFlags::all());
    let _ = r.bind(
        &MemPolicy::Bind(zero),
        MbindFlags::from_bits_retain(u32::MAX as _),
    );
}

#[test]
fn migrate_process_with_odd_pids() {
    let mut zero = NodeSet::new();
    zero.insert(Node(0));
    for pid in [0, -1, -2, i32::MAX, i32::MIN, 1] {
        match numapin::migrate_process(pid, &zero, &zero) {
            Ok(o) => eprintln!("pid {pid}: {o:?}"),
            Err(e) => eprintln!("pid {pid}: {e}"),
        }
    }
}

/// A scratch directory of this test binary's own.
fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("numapin-attack3-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A safetensors file of one f16 tensor of 4 elements named `tensor`.
fn write_one(path: &std::path::Path, tensor: &str) {
    let header = format!(r#"{{"{tensor}":{{"dtype":"F16","shape":[4],"data_offsets":[0,8]}}}}"#);
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(&[0u8; 8]);
    std::fs::write(path, bytes).unwrap();
}

/// An index naming a shard outside its directory (`../`, an absolute path, a
/// subdirectory) is refused before that file is opened: a checkpoint is its directory.
#[cfg(feature = "model")]
#[test]
fn index_shards_outside_the_directory_are_refused_unopened() {
    use numapin::model::Checkpoint;
    let root = scratch("index-paths");
    let dir = root.join("ckpt");
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    write_one(&root.join("outside.safetensors"), "t");
    write_one(&dir.join("sub/inner.safetensors"), "t");
    // A FIFO outside: opening it (to read a header) would block for ever.
    let fifo = dir.join("fifo.safetensors");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    rustix::fs::mkfifoat(rustix::fs::CWD, c.as_c_str(), rustix::fs::Mode::RWXU).unwrap();
    let outside = root.join("outside.safetensors");
    for shard in [
        "../outside.safetensors",
        outside.to_str().unwrap(),
        "sub/inner.safetensors",
        "./../outside.safetensors",
        "..",
        "",
    ] {
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            format!(r#"{{"weight_map":{{"t":"{shard}"}}}}"#),
        )
        .unwrap();
        let e = Checkpoint::open(&dir).unwrap_err();
        assert!(e.to_string().contains("is not a file name"), "{shard}: {e}");
    }
    // A FIFO in the directory: refused, not opened (which would block).
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        r#"{"weight_map":{"t":"fifo.safetensors"}}"#,
    )
    .unwrap();
    assert!(Checkpoint::open(&dir).is_err());
    let _ = std::fs::remove_dir_all(&root);
}

/// A hook that calls back into its own store, from inside the load: packing the same
/// layer (refused, in progress), another layer (nested load), and reading slots. Nothing
/// deadlocks; the outer pack completes.
#[test]
fn a_progress_hook_that_calls_back_into_the_store() {
    use numapin::store::ProgressHook;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex, OnceLock};
    let cell: Arc<OnceLock<Arc<PinStore>>> = Arc::new(OnceLock::new());
    let seen = Arc::new(Mutex::new(Vec::<String>::new()));
    let nested = Arc::new(AtomicBool::new(false));
    let (c, s, n) = (cell.clone(), seen.clone(), nested.clone());
    let hook = ProgressHook::new(move |p| {
        let Some(store) = c.get() else { return };
        let w = vec![3u8; 5000];
        let sources = [ExpertSource::Memory {
            weights: &w,
            scales: &[],
        }];
        let spec = LayerSpec {
            experts: 1,
            weight_bytes: 5000,
            scale_bytes: 0,
        };
        let again = store.pack_layer(p.layer, &spec, &sources);
        s.lock()
            .unwrap()
            .push(format!("same layer {}: {:?}", p.layer, again.map(|_| ())));
        if !n.swap(true, Ordering::SeqCst) {
            let other = store.pack_layer(p.layer + 1, &spec, &sources);
            s.lock()
                .unwrap()
                .push(format!("layer {}: {:?}", p.layer + 1, other.map(|_| ())));
        }
        let _ = store.weights(p.layer, 0);
        let _ = store.stats();
    });
    let options = StoreOptions::default()
        .progress(Some(hook.clone()))
        .loader_threads(2);
    let store = Arc::new(PinStore::new(Layout::Unplaced, options).unwrap());
    cell.set(store.clone()).ok().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let s2 = store.clone();
    std::thread::spawn(move || {
        let w = vec![1u8; 40 << 20];
        let sources: Vec<ExpertSource> = w
            .chunks(1 << 20)
            .map(|c| ExpertSource::Memory {
                weights: c,
                scales: &[],
            })
            .collect();
        let spec = LayerSpec {
            experts: 40,
            weight_bytes: 1 << 20,
            scale_bytes: 0,
        };
        tx.send(s2.pack_layer(0, &spec, &sources).map(|_| ()))
            .unwrap();
    });
    let outcome = rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("pack_layer hung with a hook calling back into the store");
    outcome.unwrap();
    assert!(!hook.panicked());
    eprintln!("{:#?}", seen.lock().unwrap());
    assert_eq!(store.weights(0, 39).unwrap()[0], 1);
}

/// Setters at their extremes: each store either packs exact bytes or is a typed error.
#[test]
fn store_options_at_their_extremes() {
    use numapin::store::SlotAlign;
    let page = page_size();
    let w: Vec<u8> = (0..3 * 5000).map(|i| i as u8).collect();
    let sources: Vec<ExpertSource> = w
        .chunks(5000)
        .map(|c| ExpertSource::Memory {
            weights: c,
            scales: &c[..7],
        })
        .collect();
    let spec = LayerSpec {
        experts: 3,
        weight_bytes: 5000,
        scale_bytes: 7,
    };
    let cases: Vec<(&str, StoreOptions)> = vec![
        ("threads 0", StoreOptions::default().loader_threads(0)),
        (
            "threads max",
            StoreOptions::default().loader_threads(usize::MAX),
        ),
        ("piece_align 0", StoreOptions::default().piece_align(0)),
        ("piece_align 3", StoreOptions::default().piece_align(3)),
        (
            "piece_align max",
            StoreOptions::default().piece_align(usize::MAX),
        ),
        (
            "piece_align 2^63",
            StoreOptions::default().piece_align(1 << 63),
        ),
        ("vma_budget 0", StoreOptions::default().vma_budget(Some(0))),
        (
            "vma_budget max",
            StoreOptions::default().vma_budget(Some(usize::MAX)),
        ),
        (
            "align page-1",
            StoreOptions::default().slot_align(SlotAlign::Bytes(page - 1)),
        ),
        (
            "align max",
            StoreOptions::default().slot_align(SlotAlign::Bytes(usize::MAX)),
        ),
    ];
    for (what, options) in cases {
        let outcome = PinStore::new(Layout::Unplaced, options)
            .and_then(|store| store.pack_layer(0, &spec, &sources).map(|_| store));
        match outcome {
            Ok(store) => {
                for e in 0..3 {
                    assert_eq!(
                        store.weights(0, e).unwrap(),
                        &w[e * 5000..][..5000],
                        "{what}"
                    );
                    assert_eq!(store.scales(0, e).unwrap(), &w[e * 5000..][..7], "{what}");
                }
                eprintln!("{what}: ok");
            }
            Err(e) => eprintln!("{what}: {e}"),
        }
    }
}
