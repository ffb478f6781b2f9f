//! What `cargo xtask test-numa` needs before it can boot: qemu, a static busybox and the
//! VM kernel, found or provisioned.
//!
//! qemu-system-x86 and busybox-static come from apt when root (otherwise the error names
//! the packages to install as root); the kernel of Debian's linux-image-cloud-amd64 is
//! fetched with `apt-get download` and unpacked into `<target dir>/numa-vm/` by any user
//! (no root needed once apt's lists exist).

use std::path::{Path, PathBuf};
use std::process::Command;

const KERNEL_META: &str = "linux-image-cloud-amd64";

pub struct Tools {
    pub qemu: PathBuf,
    pub busybox: PathBuf,
    pub kernel: PathBuf,
}

fn is_root() -> bool {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() == 0 }
}

fn find_in_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

fn static_busybox() -> Option<PathBuf> {
    ["/bin/busybox", "/usr/bin/busybox"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file() && shared_libraries(p).is_ok_and(|libs| libs.is_empty()))
}

fn output(cmd: &mut Command) -> Result<String, String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn apt(args: &[&str], dir: Option<&Path>) -> Result<String, String> {
    let mut cmd = Command::new("apt-get");
    cmd.args(args).env("DEBIAN_FRONTEND", "noninteractive");
    if let Some(dir) = dir {
        cmd.current_dir(dir);
    }
    eprintln!("xtask: running {cmd:?}");
    output(&mut cmd)
}

/// Finds or installs qemu, a static busybox and the VM kernel.
///
/// The kernel needs no root: `apt-get download` and `dpkg-deb -x` work as any user once
/// apt's package lists exist. Installing qemu and busybox does need root; without it the
/// error says which packages to install, after the kernel has been fetched anyway.
pub fn provision(cache: &Path) -> Result<Tools, String> {
    let kernel = cache.join("vmlinuz");
    let missing_packages: Vec<&str> = [
        (
            "qemu-system-x86",
            find_in_path("qemu-system-x86_64").is_none(),
        ),
        ("busybox-static", static_busybox().is_none()),
    ]
    .iter()
    .filter(|(_, missing)| *missing)
    .map(|(p, _)| *p)
    .collect();
    let mut problems = Vec::new();
    if !missing_packages.is_empty() {
        if is_root() {
            eprintln!(
                "xtask: installing {} with apt-get",
                missing_packages.join(", ")
            );
            let mut install = vec!["install", "-y", "--no-install-recommends"];
            install.extend(&missing_packages);
            if apt(&install, None).is_err() {
                apt(&["update"], None)?;
                apt(&install, None)?;
            }
        } else {
            problems.push(format!(
                "missing {}: installing packages needs root; as root run:\n  \
                 apt-get update && apt-get install -y {}",
                missing_packages.join(", "),
                missing_packages.join(" ")
            ));
        }
    }
    if !kernel.is_file()
        && let Err(e) = fetch_kernel(cache, &kernel)
    {
        problems.push(format!(
            "the VM kernel ({KERNEL_META}) could not be fetched: {e}\n\
             by hand (no root needed once apt's lists exist):\n  \
             cd {} && apt-get download $(apt-cache depends {KERNEL_META} | awk '/Depends: linux-image/{{print $2; exit}}') \\\n    \
             && dpkg-deb -x linux-image-*.deb kernel && cp kernel/boot/vmlinuz-* vmlinuz",
            cache.display()
        ));
    }
    if !problems.is_empty() {
        return Err(problems.join("\n"));
    }
    Ok(Tools {
        qemu: find_in_path("qemu-system-x86_64")
            .ok_or("qemu-system-x86_64 is still missing after apt-get")?,
        busybox: static_busybox().ok_or("a static busybox is still missing after apt-get")?,
        kernel,
    })
}

/// `apt-get download` the versioned kernel package the cloud meta-package depends on,
/// and unpack its vmlinuz.
fn fetch_kernel(cache: &Path, kernel: &Path) -> Result<(), String> {
    let depends = |()| output(Command::new("apt-cache").args(["depends", KERNEL_META]));
    let text = match depends(()) {
        Ok(t) if t.contains("Depends: linux-image") => t,
        // Refreshing apt's lists is the one step that needs root.
        _ if is_root() => {
            apt(&["update"], None)?;
            depends(())?
        }
        _ => {
            return Err(format!(
                "apt-cache knows no {KERNEL_META} (apt's package lists are missing or stale); \
                 as root run: apt-get update"
            ));
        }
    };
    let package = text
        .lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix("Depends: ")
                .filter(|p| p.starts_with("linux-image-"))
        })
        .ok_or_else(|| format!("apt-cache depends {KERNEL_META} names no kernel package:\n{text}"))?
        .to_string();
    eprintln!("xtask: fetching the VM kernel from {package}");
    let download = cache.join("download");
    let _ = std::fs::remove_dir_all(&download);
    std::fs::create_dir_all(&download).map_err(|e| e.to_string())?;
    apt(&["download", &package], Some(&download))?;
    let deb = std::fs::read_dir(&download)
        .map_err(|e| e.to_string())?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .ok_or("apt-get download left no .deb")?;
    let unpacked = download.join("unpacked");
    output(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&unpacked))?;
    let vmlinuz = std::fs::read_dir(unpacked.join("boot"))
        .map_err(|e| e.to_string())?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz"))
        })
        .ok_or("the kernel package has no boot/vmlinuz")?;
    std::fs::copy(&vmlinuz, kernel).map_err(|e| format!("copy {}: {e}", vmlinuz.display()))?;
    let _ = std::fs::remove_dir_all(&download);
    Ok(())
}

/// The libraries `ldd` names for a binary (empty for a static one).
pub fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>, String> {
    let out = Command::new("ldd")
        .arg(binary)
        .output()
        .map_err(|e| format!("ldd: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text
        .lines()
        .filter_map(|l| {
            let path = match l.split_once("=>") {
                Some((_, rest)) => rest.split_whitespace().next()?,
                None => l.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect())
}
