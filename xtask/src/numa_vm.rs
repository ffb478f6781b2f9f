//! `cargo xtask test-numa`: the test binaries in a qemu VM with four NUMA nodes (TCG):
//! nodes 0-2 with 512 MiB and one CPU each, node 3 a CPU without memory.
//!
//! Provisioning: qemu-system-x86 and busybox-static from apt when root (otherwise the
//! error names the packages to install as root); the kernel of Debian's
//! linux-image-cloud-amd64, fetched with `apt-get download` and unpacked into
//! `<target dir>/numa-vm/` by any user (no root needed once apt's lists exist). The initramfs (busybox, the release test binaries, the main-job
//! example, the shared libraries `ldd` names, and the checkpoint fixtures at `/fixtures`
//! with `NUMAPIN_FIXTURES` pointing there) is written by `cpio.rs`; `/init` runs
//! each case between markers on the serial console, which this module reads with a
//! deadline.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::binaries::{self, TestBinary};
use crate::cpio::Archive;
use crate::report::{self, Outcome};

const KERNEL_META: &str = "linux-image-cloud-amd64";
const BEGIN: &str = "@@NUMAPIN-BEGIN ";
const END: &str = "@@NUMAPIN-END ";
const DONE: &str = "@@NUMAPIN-DONE@@";
const TOPOLOGY: &str = "@@NUMAPIN-TOPOLOGY ";
/// 2 MiB hugetlbfs pages reserved in the VM.
const VM_HUGE_PAGES: usize = 32;
/// The lowered limit of the map-limit scenario.
const LOW_MAP_LIMIT: usize = 4096;
/// The main job's model in the VM: small enough for 1.5 GiB of RAM and tmpfs.
const PIN_MODEL_ARGS: &str = "--json --layers 6 --experts 24";
/// Where the checkpoint fixtures (`target/fixtures`, ~2 MB) go in the initramfs.
const VM_FIXTURES: &str = "/fixtures";
/// Mutated headers per format in the VM: TCG runs the parsers ~10× slower than the host.
const VM_FUZZ_CASES: usize = 10_000;
/// Operations of the randomized cache test under TCG (1,000,000 on the host).
const VM_CACHE_OPS: usize = 100_000;

struct Tools {
    qemu: PathBuf,
    busybox: PathBuf,
    kernel: PathBuf,
}

pub fn run() -> Result<(), String> {
    let started = Instant::now();
    let required = std::env::var("NUMAPIN_REQUIRE_VM").is_ok_and(|v| v == "1");
    let cache = crate::target_dir()?.join("numa-vm");
    std::fs::create_dir_all(&cache).map_err(|e| format!("{}: {e}", cache.display()))?;
    let tools = match provision(&cache) {
        Ok(tools) => tools,
        Err(e) if !required => {
            println!("test-numa: NOT RUN: the VM cannot be provisioned here:\n{e}");
            println!("(set NUMAPIN_REQUIRE_VM=1 to make this a failure)");
            return Ok(());
        }
        Err(e) => return Err(format!("test-numa: the VM cannot be provisioned:\n{e}")),
    };
    let tests = binaries::build(true)?;
    let pin_model = binaries::build_example("pin_model")?;
    let initramfs = cache.join("initramfs.cpio");
    let fixtures = crate::fixtures::existing();
    build_initramfs(&tools, &tests, &pin_model, fixtures.as_deref(), &initramfs)?;

    let timeout = std::env::var("NUMAPIN_VM_TIMEOUT")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(Duration::from_secs(900), Duration::from_secs);
    let console_log = cache.join("console.log");
    let (console, seconds) = boot(&tools, &initramfs, &console_log, timeout)?;
    let mut outcomes = evaluate(&console, &tests)?;
    for o in &mut outcomes {
        o.seconds = seconds.get(&o.binary).copied().unwrap_or(0.0);
    }
    report::print_table(
        "test-numa (4-node VM: nodes 0-2 with 512 MiB each, node 3 memoryless)",
        &outcomes,
    );
    println!(
        "test-numa took {:.0} s in all",
        started.elapsed().as_secs_f64()
    );
    if report::all_ok(&outcomes) {
        Ok(())
    } else {
        Err(format!(
            "test-numa: failures above (console: {})",
            console_log.display()
        ))
    }
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
fn provision(cache: &Path) -> Result<Tools, String> {
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
fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>, String> {
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

fn file_name(test: &TestBinary) -> String {
    test.name
        .replace(" (unit)", "_unit")
        .replace(|c: char| !c.is_ascii_alphanumeric() && c != '_', "_")
}

/// One step of `/init`.
struct Case {
    name: String,
    command: String,
}

/// The steps of a VM run; `NUMAPIN_VM_ONLY=name,...` keeps only those (for iterating on
/// one binary; CI runs all).
fn cases(tests: &[TestBinary]) -> Vec<Case> {
    let mut cases = all_cases(tests);
    if let Ok(only) = std::env::var("NUMAPIN_VM_ONLY") {
        let only: Vec<&str> = only.split(',').collect();
        cases.retain(|c| only.contains(&c.name.as_str()));
    }
    cases
}

fn all_cases(tests: &[TestBinary]) -> Vec<Case> {
    let mut cases: Vec<Case> = tests
        .iter()
        .filter(|t| t.name != "map_limit")
        .map(|t| Case {
            name: t.name.clone(),
            command: format!("/t/{} --test-threads=2", file_name(t)),
        })
        .collect();
    if tests.iter().any(|t| t.name == "map_limit") {
        cases.push(Case {
            name: format!("map_limit@{LOW_MAP_LIMIT}"),
            command: format!(
                "sh -c 'echo {LOW_MAP_LIMIT} > /proc/sys/vm/max_map_count && NUMAPIN_MAP_LIMIT={LOW_MAP_LIMIT} /t/map_limit --test-threads=1'"
            ),
        });
    }
    cases.push(Case {
        name: "pin_model".into(),
        command: format!("/x/pin_model {PIN_MODEL_ARGS}"),
    });
    cases
}

fn init_script(cases: &[Case], fixtures: bool) -> String {
    let mut s = String::from(
        "#!/bin/busybox sh\n\
         /bin/busybox --install -s /bin\n\
         mount -t proc proc /proc\n\
         mount -t sysfs sysfs /sys\n\
         mount -t devtmpfs devtmpfs /dev 2>/dev/null\n\
         mount -t tmpfs tmpfs /tmp\n\
         N=/sys/devices/system/node\n",
    );
    s += &format!(
        "echo \"{TOPOLOGY}possible=$(cat $N/possible) memory=$(cat $N/has_memory) cpus=$(cat $N/has_cpu)@@\"\n"
    );
    // A small hugetlbfs pool, so the huge-page memfd tests take their success path here.
    s += &format!("echo {VM_HUGE_PAGES} > /proc/sys/vm/nr_hugepages\n");
    s += &format!("export NUMAPIN_HUGEPAGES={VM_HUGE_PAGES}\n");
    s += "export NUMAPIN_EXPECT=full NUMAPIN_TEST_NODES=4 RUST_BACKTRACE=1 TMPDIR=/tmp\n";
    s += &format!("export NUMAPIN_FUZZ_CASES={VM_FUZZ_CASES}\n");
    s += &format!("export NUMAPIN_CACHE_OPS={VM_CACHE_OPS}\n");
    if fixtures {
        s += &format!("export NUMAPIN_FIXTURES={VM_FIXTURES}\n");
    }
    for case in cases {
        s += &format!(
            "echo \"{BEGIN}{name}@@\"\n{command} 2>&1\necho \"{END}{name} $?@@\"\n",
            name = case.name,
            command = case.command
        );
    }
    s += &format!("echo \"{DONE}\"\npoweroff -f\n");
    s
}

fn build_initramfs(
    tools: &Tools,
    tests: &[TestBinary],
    pin_model: &Path,
    fixtures: Option<&Path>,
    out: &Path,
) -> Result<(), String> {
    let read = |p: &Path| std::fs::read(p).map_err(|e| format!("read {}: {e}", p.display()));
    let mut archive = Archive::default();
    for dir in [
        "proc", "sys", "dev", "tmp", "t", "x", "bin", "sbin", "usr/bin", "usr/sbin",
    ] {
        archive.dir(dir);
    }
    archive.file("/bin/busybox", &read(&tools.busybox)?, true);
    archive.file(
        "/init",
        init_script(&cases(tests), fixtures.is_some()).as_bytes(),
        true,
    );
    if let Some(dir) = fixtures {
        let bytes = add_tree(&mut archive, dir, VM_FIXTURES)?;
        eprintln!(
            "xtask: fixtures from {} ({bytes} bytes) at {VM_FIXTURES} in the VM",
            dir.display()
        );
    }
    let mut libraries = std::collections::BTreeSet::new();
    for test in tests {
        archive.file(&format!("/t/{}", file_name(test)), &read(&test.path)?, true);
        libraries.extend(shared_libraries(&test.path)?);
    }
    archive.file("/x/pin_model", &read(pin_model)?, true);
    libraries.extend(shared_libraries(pin_model)?);
    for lib in &libraries {
        archive.file(&lib.to_string_lossy(), &read(lib)?, true);
    }
    let file = std::fs::File::create(out).map_err(|e| format!("{}: {e}", out.display()))?;
    archive
        .finish(std::io::BufWriter::new(file))
        .map_err(|e| format!("write {}: {e}", out.display()))
}

/// Adds every file below `dir` to the archive under `at`, in name order; returns their
/// bytes.
fn add_tree(archive: &mut Archive, dir: &Path, at: &str) -> Result<u64, String> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("read_dir {}: {e}", dir.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()
        .map_err(|e| format!("read_dir {}: {e}", dir.display()))?;
    paths.sort();
    let mut bytes = 0;
    for path in paths {
        let name = path
            .file_name()
            .ok_or_else(|| format!("{} has no file name", path.display()))?
            .to_string_lossy();
        let inside = format!("{at}/{name}");
        if path.is_dir() {
            bytes += add_tree(archive, &path, &inside)?;
        } else {
            let data = std::fs::read(&path).map_err(|e| format!("read {}: {e}", path.display()))?;
            bytes += data.len() as u64;
            archive.file(&inside, &data, false);
        }
    }
    Ok(bytes)
}

/// Boots the VM and returns its console, or fails on a timeout with the console tail.
fn boot(
    tools: &Tools,
    initramfs: &Path,
    log: &Path,
    timeout: Duration,
) -> Result<(String, BTreeMap<String, f64>), String> {
    let mut cmd = Command::new(&tools.qemu);
    cmd.args([
        "-accel",
        "tcg",
        "-cpu",
        "max",
        "-nodefaults",
        "-display",
        "none",
        "-no-reboot",
    ])
    .args(["-smp", "4,sockets=4,cores=1,threads=1", "-m", "1536M"]);
    for node in 0..3 {
        cmd.args([
            "-object",
            &format!("memory-backend-ram,id=m{node},size=512M"),
        ])
        .args([
            "-numa",
            &format!("node,nodeid={node},cpus={node},memdev=m{node}"),
        ]);
    }
    cmd.args(["-numa", "node,nodeid=3,cpus=3"]);
    // Non-uniform distances, so that "nearest" and "first" differ: the memoryless node 3
    // is near node 2 and far from 0 and 1. qemu wants every pair (a partial table makes
    // it exit); it mirrors each to the other direction.
    for (a, b, distance) in [
        (0, 1, 20),
        (0, 2, 20),
        (1, 2, 20),
        (0, 3, 30),
        (1, 3, 30),
        (2, 3, 15),
    ] {
        cmd.args(["-numa", &format!("dist,src={a},dst={b},val={distance}")]);
    }
    cmd.arg("-kernel")
        .arg(&tools.kernel)
        .arg("-initrd")
        .arg(initramfs)
        .args([
            "-append",
            "console=ttyS0 rdinit=/init panic=-1 loglevel=4",
            "-serial",
            "stdio",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    eprintln!("xtask: booting {cmd:?}");
    let started = Instant::now();
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("{}: {e}", tools.qemu.display()))?;
    let stdout = child.stdout.take().ok_or("qemu stdout")?;
    let stderr = child.stderr.take().ok_or("qemu stderr")?;
    let (tx, rx) = mpsc::channel::<String>();
    let err_tx = tx.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = err_tx.send(format!("qemu: {line}"));
        }
    });
    let mut console = String::new();
    let mut log_file = std::fs::File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
    let mut booted = None;
    let mut case_started: Option<(String, f64)> = None;
    let mut seconds = BTreeMap::new();
    let deadline = started + timeout;
    let outcome = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                let _ = writeln!(log_file, "{line}");
                if line.starts_with(TOPOLOGY) && booted.is_none() {
                    booted = Some(started.elapsed());
                    eprintln!(
                        "xtask: VM booted in {:.1} s: {line}",
                        started.elapsed().as_secs_f64()
                    );
                }
                let now = started.elapsed().as_secs_f64();
                if let Some(name) = line.strip_prefix(BEGIN) {
                    let name = name.trim_end_matches('@').to_string();
                    eprintln!("xtask: [{now:>5.0} s] {name}");
                    case_started = Some((name, now));
                }
                if line.starts_with(END)
                    && let Some((name, at)) = case_started.take()
                {
                    seconds.insert(name, now - at);
                }
                let done = line.contains(DONE);
                let panic = line.contains("Kernel panic");
                console.push_str(&line);
                console.push('\n');
                if done {
                    break Ok(());
                }
                if panic {
                    break Err("the VM kernel panicked".to_string());
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                break Err(format!(
                    "the VM did not finish within {} s",
                    timeout.as_secs()
                ));
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                break Err("qemu exited before the test run finished".to_string());
            }
        }
    };
    // poweroff -f follows DONE at once; give qemu a moment, then make sure it is gone.
    let stop_by = Instant::now() + Duration::from_secs(10);
    while Instant::now() < stop_by && child.try_wait().ok().flatten().is_none() {
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
    match outcome {
        Ok(()) => Ok((console, seconds)),
        Err(e) => {
            let tail: Vec<&str> = console.lines().rev().take(80).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            Err(format!(
                "{e}; console tail ({}):\n{}",
                log.display(),
                tail.join("\n")
            ))
        }
    }
}

/// Splits the console into cases and judges each.
fn evaluate(console: &str, tests: &[TestBinary]) -> Result<Vec<Outcome>, String> {
    let topology = console
        .lines()
        .find_map(|l| l.strip_prefix(TOPOLOGY))
        .ok_or("the VM printed no topology line")?;
    if !topology.contains("memory=0-2") || !topology.contains("cpus=0-3") {
        return Err(format!(
            "the VM's topology is not the one asked for: {topology}"
        ));
    }
    let mut outcomes = Vec::new();
    for case in cases(tests) {
        let begin = format!("{BEGIN}{}@@", case.name);
        let start = console
            .find(&begin)
            .ok_or_else(|| format!("case {} never started", case.name))?;
        let body = &console[start + begin.len()..];
        let end_marker = format!("{END}{} ", case.name);
        let end = body
            .find(&end_marker)
            .ok_or_else(|| format!("case {} never ended", case.name))?;
        let output = &body[..end];
        let status: i32 = body[end + end_marker.len()..]
            .split("@@")
            .next()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(-1);
        let (mut passed, mut failed) = report::parse_counts(output);
        let mut ok = status == 0;
        if case.name == "pin_model" {
            match check_pin_model(output) {
                Ok(()) => passed += 1,
                Err(e) => {
                    eprintln!("pin_model in the VM: {e}\n{output}");
                    failed += 1;
                    ok = false;
                }
            }
        }
        if !ok || failed > 0 {
            eprintln!("--- {} failed in the VM (exit {status}):", case.name);
            let tail: Vec<&str> = output.lines().rev().take(60).collect();
            tail.iter().rev().for_each(|l| eprintln!("  {l}"));
        }
        outcomes.push(Outcome {
            env: "numa-vm".into(),
            binary: case.name.clone(),
            passed,
            failed,
            ok,
            not_run: report::count_not_run(output),
            seconds: 0.0,
        });
    }
    Ok(outcomes)
}

/// The main job's JSON must show pages on all three memory nodes.
fn check_pin_model(output: &str) -> Result<(), String> {
    let json = output
        .lines()
        .find(|l| l.trim_start().starts_with('{'))
        .ok_or("no JSON line")?;
    let pages = json
        .split("\"pages_per_node\":{")
        .nth(1)
        .and_then(|rest| rest.split('}').next())
        .ok_or("no pages_per_node")?;
    let nodes: Vec<(&str, u64)> = pages
        .split(',')
        .filter_map(|kv| {
            let (k, v) = kv.split_once(':')?;
            Some((k.trim_matches('"'), v.parse().ok()?))
        })
        .collect();
    let with_pages = nodes.iter().filter(|(_, p)| *p > 0).count();
    if with_pages < 3 || !json.contains("\"placement\":\"bound\"") {
        return Err(format!(
            "expected bound pages on 3 nodes, got {pages:?} in {json}"
        ));
    }
    println!("pin_model in the VM: pages per node {{{pages}}}");
    Ok(())
}
