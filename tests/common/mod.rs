//! What the environment promises, so every test asserts the right outcome everywhere.
//!
//! `NUMAPIN_EXPECT` = `full` | `denied` | `unsupported` | `sys-nice` says what the NUMA
//! syscalls must do here (the xtask sets it for each environment); unset, the probe
//! decides. The first three hold for both syscall groups; `sys-nice` is Docker with
//! `--cap-add SYS_NICE`: the policy calls work (`full`), the page calls (`move_pages`,
//! `migrate_pages`) are denied. [`expect`] answers for the policy calls,
//! [`expect_pages`] for the page calls: a test that uses `move_pages` (placement, moves,
//! `migrate_process`) branches on the latter.
//! `NUMAPIN_TEST_NODES` says how many memory nodes a multi-node test may count on.
#![allow(dead_code)]

pub mod dbrx_files;

use numapin::{Errno, MempolicySupport, NodeHistogram, NodeSet, PagesSource};

use numapin::policy::DegradeReason;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    Full,
    Denied,
    Unsupported,
}

fn from_support(support: MempolicySupport) -> Expect {
    match support {
        MempolicySupport::Available => Expect::Full,
        MempolicySupport::Denied => Expect::Denied,
        MempolicySupport::Unsupported => Expect::Unsupported,
    }
}

/// (policy calls, page calls) as promised, or as probed when nothing is promised.
fn expectations() -> (Expect, Expect) {
    match std::env::var("NUMAPIN_EXPECT").as_deref() {
        Ok("full") => (Expect::Full, Expect::Full),
        Ok("denied") => (Expect::Denied, Expect::Denied),
        Ok("unsupported") => (Expect::Unsupported, Expect::Unsupported),
        Ok("sys-nice") => (Expect::Full, Expect::Denied),
        Ok(other) => {
            panic!("NUMAPIN_EXPECT={other:?}: expected full, denied, unsupported or sys-nice")
        }
        Err(_) => (
            from_support(numapin::mempolicy_support().expect("probe")),
            from_support(numapin::page_calls_support().expect("probe")),
        ),
    }
}

/// What the policy calls (`mbind`, `set_mempolicy`, `get_mempolicy`) do here.
pub fn expect() -> Expect {
    expectations().0
}

/// What the page calls (`move_pages`, `migrate_pages`) do here.
pub fn expect_pages() -> Expect {
    expectations().1
}

/// The degradation `move_pages_to` and `migrate_process` report here, if any.
pub fn degrade_pages_here() -> Option<DegradeReason> {
    match expect_pages() {
        Expect::Full => None,
        Expect::Denied => Some(DegradeReason::Denied),
        Expect::Unsupported => Some(DegradeReason::Unsupported),
    }
}

/// Where `Region::placement` reads placement here: `move_pages` where the page calls
/// work, `numa_maps` where they are denied, nowhere on a kernel without NUMA.
pub fn pages_source_here() -> Option<PagesSource> {
    match expect_pages() {
        Expect::Full => Some(PagesSource::MovePages),
        Expect::Denied => Some(PagesSource::NumaMaps),
        Expect::Unsupported => None,
    }
}

/// `Region::placement`'s answer checked against this environment: a histogram from the
/// expected source, or the expected degradation where there is none.
pub fn placement_here(observed: numapin::policy::Observed<NodeHistogram>) -> Option<NodeHistogram> {
    match observed {
        numapin::policy::Observed::Known(h) => {
            assert_eq!(Some(h.source), pages_source_here(), "{h:?}");
            Some(h)
        }
        numapin::policy::Observed::Degraded(reason) => {
            assert_eq!(pages_source_here(), None, "degraded: {reason}");
            assert_eq!(Some(reason), degrade_pages_here());
            None
        }
    }
}

/// Checks a histogram of `pages` pages of a fenced region (`Region::anonymous_fenced`)
/// from the expected source: every page is accounted for, and none is lost to a merged
/// neighbour (a region of its own never shares a mapping, so `numa_maps` counts it alone).
pub fn whole(h: &NodeHistogram, pages: usize) {
    assert_eq!(Some(h.source), pages_source_here(), "{h:?}");
    assert_eq!(h.merged, 0, "a fenced region shared a mapping: {h:?}");
    assert_eq!(h.present() + h.not_present + h.other, pages, "{h:?}");
}

/// The errno a NUMA syscall gives here when the kernel itself would answer `full`.
pub fn errno_here(full: Errno) -> Errno {
    match expect() {
        Expect::Full => full,
        Expect::Denied => Errno::PERM,
        Expect::Unsupported => Errno::NOSYS,
    }
}

/// `Ok` where the calls work, the degradation errno elsewhere.
pub fn ok_here() -> Result<(), Errno> {
    match expect() {
        Expect::Full => Ok(()),
        Expect::Denied => Err(Errno::PERM),
        Expect::Unsupported => Err(Errno::NOSYS),
    }
}

pub fn degrade_here() -> Option<numapin::policy::DegradeReason> {
    match expect() {
        Expect::Full => None,
        Expect::Denied => Some(numapin::policy::DegradeReason::Denied),
        Expect::Unsupported => Some(numapin::policy::DegradeReason::Unsupported),
    }
}

/// The memory nodes the test may use, checked against `NUMAPIN_TEST_NODES`.
pub fn nodes() -> NodeSet {
    let allowed = NodeSet::allowed().expect("allowed nodes");
    if let Ok(n) = std::env::var("NUMAPIN_TEST_NODES") {
        let n: usize = n.parse().expect("NUMAPIN_TEST_NODES is a number");
        let possible = numapin::possible_node_count();
        assert!(
            possible >= n,
            "NUMAPIN_TEST_NODES={n} but the kernel has {possible} possible nodes"
        );
    }
    allowed
}

/// For a test that needs `n` memory nodes: `Some(nodes)` when they exist; otherwise it
/// prints that it did not run (and fails if `NUMAPIN_TEST_NODES` promised them).
pub fn need_nodes(test: &str, n: usize) -> Option<NodeSet> {
    let nodes = nodes();
    if expect() == Expect::Full && nodes.len() >= n {
        return Some(nodes);
    }
    let promised = std::env::var("NUMAPIN_TEST_NODES")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(1);
    assert!(
        promised < 2 || expect() != Expect::Full,
        "{test}: needs {n} memory nodes; NUMAPIN_TEST_NODES={promised} promised a NUMA machine \
         but only {} memory nodes are allowed",
        nodes.len()
    );
    // Straight to the process's stderr: libtest captures `eprintln!` of passing tests,
    // and this line must be seen (the xtask counts them).
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "NOT RUN: {test} needs {n} memory nodes with placement available; here: {} nodes ({:?})",
        nodes.len(),
        expect()
    );
    None
}

/// For a test whose figures another test thread of the binary could change (the map
/// count, the process's RSS): `true` in a child process that runs this test alone; in
/// the parent, runs that child, asserts that it passed, and returns `false`.
pub fn alone(test: &str) -> bool {
    const ROLE: &str = "NUMAPIN_TEST_ALONE";
    if std::env::var(ROLE).is_ok_and(|r| r == test) {
        return true;
    }
    let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(ROLE, test)
        .output()
        .expect("run the test alone");
    assert!(
        out.status.success(),
        "{test} alone failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // `--exact` with a name that is not the test's full path (`module::test` in a
    // directory test) runs nothing and passes: that must fail here.
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("test result: ok. 1 passed"),
        "{test} alone ran no test:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    false
}

/// The fixtures directory (`NUMAPIN_FIXTURES`, written by `cargo xtask fixtures`), or
/// `None` after saying that `test` did not run without it.
pub fn fixtures(test: &str) -> Option<std::path::PathBuf> {
    match std::env::var_os("NUMAPIN_FIXTURES") {
        Some(dir) => Some(std::path::PathBuf::from(dir)),
        None => {
            // Straight to the process's stderr, as in `need_nodes`.
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "NOT RUN: {test}: set NUMAPIN_FIXTURES (`cargo xtask fixtures` writes them into \
                 <target>/fixtures; `cargo xtask test` does it itself)"
            );
            None
        }
    }
}

/// Pages per node of the `len / page` whole pages at `ptr`, from the kernel's own
/// answer (`move_pages` with no target nodes: a query that moves nothing), independent
/// of numapin's placement readers. A page not present counts as `not_present`.
pub fn pages_of(ptr: *const u8, len: usize) -> NodeHistogram {
    let page = numapin::page_size();
    let pages: Vec<*mut std::ffi::c_void> = (0..len / page)
        .map(|i| ptr.wrapping_add(i * page) as *mut _)
        .collect();
    let mut status = vec![0i32; pages.len()];
    // SAFETY: a query (null nodes) that only writes `status`, as many entries as pages;
    // the kernel looks the addresses up itself (an unmapped one is a status, not a fault).
    unsafe {
        numapin_sys::move_pages(
            0,
            pages.len() as u64,
            pages.as_ptr(),
            std::ptr::null(),
            status.as_mut_ptr(),
            0,
        )
    }
    .unwrap();
    let mut h = NodeHistogram::default();
    for s in status {
        match s {
            s if s >= 0 => *h.pages.entry(numapin::Node(s as u16)).or_default() += 1,
            _ => h.not_present += 1,
        }
    }
    h
}

/// [`pages_of`] the pages `bytes` touches, rounded out to whole pages (a slot's region
/// is page-aligned and one policy covers it).
pub fn pages_of_bytes(bytes: &[u8]) -> NodeHistogram {
    let page = numapin::page_size();
    let start = bytes.as_ptr() as usize / page * page;
    let end = (bytes.as_ptr() as usize + bytes.len()).div_ceil(page) * page;
    pages_of(start as *const u8, end - start)
}

/// numpy's side of a fixture: (name, shape, bytes) of every tensor, from the
/// `tensors.json` the fixture script wrote beside it.
pub fn numpy_tensors(root: &std::path::Path) -> Vec<(String, Vec<u64>, Vec<u8>)> {
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(root.join("tensors.json")).unwrap()).unwrap();
    json.as_array()
        .unwrap()
        .iter()
        .map(|t| {
            let shape = t["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap())
                .collect();
            let bytes = std::fs::read(root.join("tensors").join(t["file"].as_str().unwrap()));
            (
                t["name"].as_str().unwrap().to_owned(),
                shape,
                bytes.unwrap(),
            )
        })
        .collect()
}

/// The checkpoint of fixture `name` under the fixtures directory `dir` (the path its
/// `fixture.json` names).
#[cfg(feature = "model")]
pub fn open_fixture(dir: &std::path::Path, name: &str) -> numapin::model::Checkpoint {
    let root = dir.join(name);
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(root.join("fixture.json")).unwrap()).unwrap();
    numapin::model::Checkpoint::open(root.join(json["path"].as_str().unwrap())).unwrap()
}

/// Bytes this process caused to be read from storage (`/proc/self/io`'s `read_bytes`:
/// the kernel's readahead included), or `None` where the kernel does not count them.
pub fn storage_read_bytes() -> Option<u64> {
    let io = std::fs::read_to_string("/proc/self/io").ok()?;
    io.lines()
        .find_map(|l| l.strip_prefix("read_bytes:"))
        .and_then(|v| v.trim().parse().ok())
}

/// `model.safetensors` in `dir`, a header with known sizes over zero bytes: a
/// `embed`-byte `model.embed_tokens.weight`, then in each of `layers`, `experts` experts
/// of gate/up/down projections, each a `weight`-byte weight and a `scale`-byte
/// `weight_scale_inv` (all U8). Returns its path.
pub fn moe_safetensors(
    dir: &std::path::Path,
    embed: u64,
    layers: &[usize],
    experts: usize,
    (weight, scale): (u64, u64),
) -> std::path::PathBuf {
    let (mut tensors, mut len) = (Vec::new(), 0u64);
    let mut add = |name: String, bytes: u64| {
        tensors.push(format!(
            r#""{name}":{{"dtype":"U8","shape":[{bytes}],"data_offsets":[{len},{}]}}"#,
            len + bytes
        ));
        len += bytes;
    };
    add("model.embed_tokens.weight".into(), embed);
    for layer in layers {
        for e in 0..experts {
            for proj in ["gate", "up", "down"] {
                let p = format!("model.layers.{layer}.mlp.experts.{e}.{proj}_proj");
                add(format!("{p}.weight"), weight);
                add(format!("{p}.weight_scale_inv"), scale);
            }
        }
    }
    let header = format!("{{{}}}", tensors.join(","));
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend(header.as_bytes());
    file.resize(file.len() + len as usize, 0);
    let path = dir.join("model.safetensors");
    std::fs::write(&path, file).unwrap();
    path
}

/// The direct-I/O alignments of `file` as `statx` reports them, (memory, offset); `None`
/// where it reports none (tmpfs, overlayfs, a kernel before 6.1): no direct read there.
pub fn dio_align(file: &std::fs::File) -> Option<(u64, u64)> {
    use rustix::fs::{AtFlags, StatxFlags};
    let s = rustix::fs::statx(file, c"", AtFlags::EMPTY_PATH, StatxFlags::DIOALIGN).ok()?;
    (s.stx_mask & StatxFlags::DIOALIGN.bits() != 0 && s.stx_dio_offset_align > 0)
        .then_some((s.stx_dio_mem_align as u64, s.stx_dio_offset_align as u64))
}

/// A directory of this process's own under `/dev/shm` (tmpfs), `<prefix>-<pid>`; `None`,
/// after printing `NOT RUN: <test> needs /dev/shm (tmpfs)`, where there is none.
pub fn shm_dir(test: &str, prefix: &str) -> Option<std::path::PathBuf> {
    let shm = std::path::Path::new("/dev/shm");
    if !shm.is_dir() {
        println!("NOT RUN: {test} needs /dev/shm (tmpfs)");
        return None;
    }
    let dir = shm.join(format!("{prefix}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    Some(dir)
}

/// Evicts `file` (at `path`) from the page cache and starts counting what this process
/// reads from the device: [`storage_read_bytes`] now; `None`, after printing `NOT RUN`,
/// where the file's pages cannot be dropped (tmpfs, ramfs) or the kernel does not count.
pub fn cold_read_count(test: &str, file: &std::fs::File, path: &std::path::Path) -> Option<u64> {
    numapin_testkit::cache::evict(file).unwrap();
    let (cached, pages) = numapin_testkit::cache::cached_pages(file).unwrap();
    let before = storage_read_bytes();
    if cached != 0 || before.is_none() {
        println!(
            "NOT RUN: {test} needs a file the page cache can drop ({cached} of {pages} pages \
             of {} stayed after eviction: ramfs or tmpfs) and /proc/self/io ({})",
            path.display(),
            if before.is_some() {
                "present"
            } else {
                "absent"
            }
        );
    }
    before.filter(|_| cached == 0)
}

/// The bytes of a safetensors file holding `(name, dtype, shape, bytes)` back to back in
/// that order, its header written here by hand (no numapin code).
pub fn safetensors_bytes(tensors: &[(&str, &str, Vec<u64>, Vec<u8>)]) -> Vec<u8> {
    let (mut at, mut entries, mut data) = (0, Vec::new(), Vec::new());
    for (name, dtype, shape, bytes) in tensors {
        entries.push(format!(
            r#""{name}":{{"dtype":"{dtype}","shape":{shape:?},"data_offsets":[{at},{}]}}"#,
            at + bytes.len()
        ));
        at += bytes.len();
        data.extend_from_slice(bytes);
    }
    let header = format!("{{{}}}", entries.join(","));
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend(header.as_bytes());
    file.extend(data);
    file
}

/// A layer's sources from memory: each expert's `(weights, scales)` bytes.
pub fn memory_sources(data: &[(Vec<u8>, Vec<u8>)]) -> Vec<numapin::store::ExpertSource<'_>> {
    data.iter()
        .map(|(w, s)| numapin::store::ExpertSource::Memory {
            weights: w,
            scales: s,
        })
        .collect()
}
