//! Fake `/sys/devices/system` trees in a temporary directory, for the topology's unit
//! tests: the shapes real machines show (SNC sockets, CXL nodes, `-1` package ids,
//! offline CPUs, missing files) without needing the machine.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A sysfs tree under a fresh temporary directory, removed on drop.
pub(crate) struct FakeSysfs {
    root: PathBuf,
}

impl FakeSysfs {
    /// An empty tree (no `node/online`: a kernel without NUMA).
    pub(crate) fn new() -> FakeSysfs {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let root = std::env::temp_dir().join(format!(
            "numapin-sysfs-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        FakeSysfs { root }
    }

    /// The directory standing for `/sys/devices/system`.
    pub(crate) fn path(&self) -> &Path {
        &self.root
    }

    /// Writes `text` to `relative` (directories created).
    pub(crate) fn write(&self, relative: &str, text: &str) -> &FakeSysfs {
        let path = self.root.join(relative);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
        self
    }

    /// Online nodes `0..distances.len()`, node `n` with the CPUs `cpus[n]` (a kernel
    /// list, empty for none) and the distance row `distances[n]`.
    pub(crate) fn nodes(&self, cpus: &[&str], distances: &[&[u32]]) -> &FakeSysfs {
        self.write("node/online", &format!("0-{}\n", distances.len() - 1));
        for (n, row) in distances.iter().enumerate() {
            let row: Vec<String> = row.iter().map(u32::to_string).collect();
            self.write(&format!("node/node{n}/distance"), &(row.join(" ") + "\n"));
            self.write(&format!("node/node{n}/cpulist"), &format!("{}\n", cpus[n]));
        }
        self
    }

    /// `cpu/cpuN/topology/physical_package_id` of each CPU of `cpus` (`0-3`).
    pub(crate) fn package(&self, cpus: std::ops::RangeInclusive<usize>, id: &str) -> &FakeSysfs {
        for cpu in cpus {
            self.write(
                &format!("cpu/cpu{cpu}/topology/physical_package_id"),
                &format!("{id}\n"),
            );
        }
        self
    }

    /// Lists `initiator` in `node/nodeN/access0/initiators/` (beside the latency and
    /// bandwidth files the kernel puts there too).
    pub(crate) fn initiator(&self, node: usize, initiator: usize) -> &FakeSysfs {
        let dir = format!("node/node{node}/access0/initiators");
        self.write(&format!("{dir}/read_latency"), "120\n");
        self.write(&format!("{dir}/node{initiator}"), "")
    }
}

impl Drop for FakeSysfs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}
