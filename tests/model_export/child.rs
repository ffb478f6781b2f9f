//! The reader: attaches the inherited fds and checks every view against numpy's bytes
//! (a sliced expert piece, which numpy's side does not cut, against the exporter's
//! digest of it), then tries to write through the memfds and the mappings.

use std::collections::HashMap;
use std::fs::File;
use std::hash::{Hash, Hasher};
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use numapin::model::{ModelManifest, PlacedModel, SliceAxis};
use numapin::{Error, Node};

use super::{CHILD, FDS, NODE};

fn digest(bytes: &[u8]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    h.finish()
}

/// The layers with experts and the ids each holds.
fn expert_layers(model: &PlacedModel) -> Vec<(usize, Vec<usize>)> {
    (0..4096)
        .filter_map(|l| Some((l, model.expert_ids(l).ok()?)))
        .collect()
}

/// The exporter's digests of its expert pieces, one line `layer expert index digest`.
pub fn sliced_digests(model: &PlacedModel) -> String {
    let mut out = String::new();
    for (layer, ids) in expert_layers(model) {
        for e in ids {
            for (i, p) in model.expert(layer, e).unwrap().iter().enumerate() {
                out.push_str(&format!("{layer} {e} {i} {}\n", digest(p.bytes)));
            }
        }
    }
    out
}

/// numpy's bytes of a tensor's part under a dense slice.
fn sliced(
    whole: &[u8],
    shape: &[u64],
    axis: SliceAxis,
    start: u64,
    len: u64,
    extent: u64,
) -> Vec<u8> {
    let (start, len, extent) = (start as usize, len as usize, extent as usize);
    match axis {
        SliceAxis::Rows => {
            let row = whole.len() / extent;
            whole[start * row..(start + len) * row].to_vec()
        }
        _ => {
            let outer: u64 = shape[..shape.len() - 1].iter().product();
            let row = whole.len() / outer as usize;
            let col = row / extent;
            whole
                .chunks(row)
                .flat_map(|r| r[start * col..(start + len) * col].to_vec())
                .collect()
        }
    }
}

#[test]
fn export_child() {
    let Some(work) = std::env::var_os(CHILD).map(PathBuf::from) else {
        return; // run by the parent only
    };
    let fds: Vec<RawFd> = std::env::var(FDS)
        .unwrap()
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    // SAFETY: the parent cleared close-on-exec on exactly these fds for this process;
    // each is owned once here.
    let files: Vec<File> = fds
        .iter()
        .map(|&fd| unsafe { File::from_raw_fd(fd) })
        .collect();
    let probe = files[0].try_clone().unwrap();
    let manifest = ModelManifest::parse(&std::fs::read(work.join("manifest")).unwrap()).unwrap();
    let fixture = PathBuf::from(std::fs::read_to_string(work.join("fixture")).unwrap());
    let exporter: HashMap<(usize, usize, usize), u64> =
        std::fs::read_to_string(work.join("sliced"))
            .unwrap()
            .lines()
            .map(|l| {
                let w: Vec<u64> = l.split(' ').map(|x| x.parse().unwrap()).collect();
                ((w[0] as usize, w[1] as usize, w[2] as usize), w[3])
            })
            .collect();
    let pinned = std::env::var(NODE).ok().map(|v| {
        let (node, layout) = v.split_once(' ').unwrap();
        let node = Node(node.parse().unwrap());
        pin_to(node);
        (node, layout.to_owned())
    });
    let read_before = super::common::storage_read_bytes();
    let model = PlacedModel::attach(&manifest, files).unwrap();
    // Attaching read nothing from storage (the fixture files are not even opened).
    if let (Some(a), Some(b)) = (read_before, super::common::storage_read_bytes()) {
        assert_eq!(a, b, "attach read from storage");
    }
    let numpy: HashMap<String, (Vec<u64>, Vec<u8>)> = super::common::numpy_tensors(&fixture)
        .into_iter()
        .map(|(n, s, b)| (n, (s, b)))
        .collect();
    let (mut tensors, mut pieces, mut copies, mut digested) = (0, 0, 0, 0);
    let mut replicated = 0;
    let mut first_view: Option<&[u8]> = None;
    for (name, (shape, whole)) in &numpy {
        let view = match model.tensor(name) {
            Ok(v) => v,
            Err(Error::NotHeld { .. }) => continue,
            Err(Error::InvalidArgument { .. }) => continue, // rows padded apart
            Err(e) => panic!("{name}: {e}"),
        };
        let Some(bytes) = view.bytes() else { continue };
        let want = match view.slice() {
            Some(s) => sliced(whole, shape, s.axis, s.start, s.len, s.extent),
            None => whole.clone(),
        };
        assert!(
            bytes == &want[..],
            "{name}: the attached bytes differ from numpy's"
        );
        if !bytes.is_empty() {
            first_view.get_or_insert(bytes);
        }
        tensors += 1;
        for (node, copy) in model.tensor_copies(name).unwrap() {
            assert!(copy == &want[..], "{name}: the copy on {node:?} differs");
            copies += 1;
        }
        let all = model.tensor_copies(name).unwrap();
        if let Some((node, _)) = &pinned
            && all.len() > 1
            && view.class() != numapin::model::TensorClass::RoutedExperts
        {
            // A replicated tensor: the reader's view is its node's copy, on its node.
            let own = all.iter().find(|(n, _)| *n == Some(*node));
            let (_, own) = own.unwrap_or_else(|| panic!("{name}: no copy on node {}", node.0));
            assert_eq!(
                own.as_ptr(),
                bytes.as_ptr(),
                "{name}: not node {}'s copy",
                node.0
            );
            assert_on(bytes, *node, name);
            replicated += 1;
        }
    }
    for (layer, ids) in expert_layers(&model) {
        for e in ids {
            for (i, p) in model.expert(layer, e).unwrap().iter().enumerate() {
                let (shape, whole) = &numpy[p.tensor];
                let chunk = whole.len() / shape[0].max(1) as usize;
                if p.bytes.len() == whole.len() {
                    assert!(p.bytes == &whole[..], "layer {layer} expert {e} {}", p.role);
                } else if p.bytes.len() == chunk && shape[0] as usize > e {
                    let at = e * chunk;
                    assert!(
                        p.bytes == &whole[at..at + chunk],
                        "layer {layer} expert {e} {}",
                        p.role
                    );
                } else {
                    // A piece cut by a slice: the exporter's bytes, digested.
                    assert_eq!(
                        exporter.get(&(layer, e, i)),
                        Some(&digest(p.bytes)),
                        "layer {layer} expert {e} {}",
                        p.role
                    );
                    digested += 1;
                }
                pieces += 1;
                if let Some((node, layout)) = &pinned {
                    let home = model.expert_store().unwrap().home_node(layer, e).unwrap();
                    match (layout.as_str(), home) {
                        ("split" | "hybrid", Some(home)) => assert_on(p.bytes, home, p.tensor),
                        ("hybrid", None) => assert_on(p.bytes, *node, p.tensor),
                        ("replicate", _) => assert_on(p.bytes, *node, p.tensor),
                        _ => {}
                    }
                }
            }
        }
    }
    assert!(first_view.is_some(), "no tensor with bytes");
    let refused = refused_writes(&probe);
    println!(
        "CHILD CHECKED {tensors} tensors {pieces} pieces {copies} copies {refused} writes refused \
         ({digested} sliced pieces against the exporter's digests)"
    );
    if let Some((node, _)) = pinned {
        println!("CHILD ON NODE {} ({replicated} replicated tensors)", node.0);
    }
}

/// Writes through the memfd: `pwrite`, `ftruncate` shorter and longer, and a shared
/// writable `mmap` (the way to make a mapping that writes the file; the attached views
/// are private read-only mappings, whose pages a write could only copy): each must fail.
/// Returns how many did.
fn refused_writes(file: &File) -> usize {
    use std::os::fd::AsRawFd;
    let len = file.metadata().unwrap().len();
    let mut refused = 0;
    refused += usize::from(file.write_at(b"x", 0).is_err());
    refused += usize::from(file.set_len(len / 2).is_err());
    refused += usize::from(file.set_len(len + 4096).is_err());
    assert_eq!(file.metadata().unwrap().len(), len);
    let page = numapin::page_size();
    // SAFETY: asks for a new shared writable mapping of the memfd; the call must fail
    // (F_SEAL_WRITE), and if it did not, the mapping is unmapped untouched.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        refused += 1;
    } else {
        // SAFETY: the mapping just made, of `page` bytes, never handed out.
        unsafe { libc::munmap(ptr, page) };
    }
    refused
}

fn pin_to(node: Node) {
    use rustix::thread::{CpuSet, sched_setaffinity};
    let cpus = numapin::topology::Topology::get().unwrap().cpus_of(node);
    assert!(!cpus.is_empty(), "node {} has no CPUs", node.0);
    let mut set = CpuSet::new();
    for c in cpus {
        set.set(c);
    }
    sched_setaffinity(None, &set).unwrap();
}

fn assert_on(bytes: &[u8], node: Node, what: &str) {
    if bytes.is_empty() {
        return;
    }
    let h = super::common::pages_of_bytes(bytes);
    assert_eq!(h.not_present, 0, "{what}: pages not present");
    assert!(
        h.pages.keys().all(|&n| n == node),
        "{what}: pages on {:?}, expected node {}",
        h.pages,
        node.0
    );
}
