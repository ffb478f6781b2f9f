//! `cargo xtask test-numa`: the test binaries in qemu VMs (TCG), two boots of one
//! initramfs: four NUMA nodes (nodes 0-2 with 768 MiB and one CPU each, node 3 a CPU
//! without memory), then two sockets with sub-NUMA clusters and a CPU-less memory node
//! (`vm_shape.rs` says which machine each boot is and which binaries it runs).
//!
//! Provisioning (qemu, busybox, the kernel) is `vm_provision.rs`. The initramfs
//! (busybox, the release test binaries, the main-job
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
use crate::vm_provision::{Tools, provision, shared_libraries};
use crate::vm_shape::Shape;

const BEGIN: &str = "@@NUMAPIN-BEGIN ";
const END: &str = "@@NUMAPIN-END ";
const DONE: &str = "@@NUMAPIN-DONE@@";
const ROOM: &str = "@@NUMAPIN-ROOM ";
const TOPOLOGY: &str = "@@NUMAPIN-TOPOLOGY ";
/// 2 MiB hugetlbfs pages reserved in the VM.
const VM_HUGE_PAGES: usize = 32;
/// The lowered limit of the map-limit scenario.
const LOW_MAP_LIMIT: usize = 4096;
/// Where the checkpoint fixtures (`target/fixtures`, ~2 MB) go in the initramfs.
const VM_FIXTURES: &str = "/fixtures";
/// Mutated headers per format in the VM: TCG runs the parsers ~10× slower than the host.
const VM_FUZZ_CASES: usize = 10_000;
/// Operations of the randomized cache tests under TCG (1,000,000 on the host): at
/// 100,000 the cache binary alone took over 13 minutes of a 4-node boot on 2 host cores.
const VM_CACHE_OPS: usize = 20_000;

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
    // tests/cli runs the command: /x/numapin, named by NUMAPIN_BIN (its compiled-in
    // CARGO_BIN_EXE path is the host's).
    let numapin = binaries::build_bin("numapin")?;
    let initramfs = cache.join("initramfs.cpio");
    let fixtures = crate::fixtures::existing();
    // `NUMAPIN_VM_BOOTS=sockets` (or `four-nodes`) boots only that machine, for iterating;
    // CI boots both.
    let boots: Vec<(Shape, Vec<Case>)> = Shape::ALL
        .into_iter()
        .filter(|shape| match std::env::var("NUMAPIN_VM_BOOTS").as_deref() {
            Ok(only) => only.split(',').any(|b| b == boot_name(*shape)),
            Err(_) => true,
        })
        .map(|shape| (shape, cases(shape, &tests)))
        .collect();
    build_initramfs(
        &tools,
        &boots,
        &tests,
        &[("pin_model", &pin_model), ("numapin", &numapin)],
        fixtures.as_deref(),
        &initramfs,
    )?;
    println!(
        "test-numa: binaries and initramfs ready in {:.0} s",
        started.elapsed().as_secs_f64()
    );

    // 35 minutes a boot: under TCG on a 2-core host the 4-node boot reached `hostile` at
    // 821 s (the cache tests alone ~13 min) and was cut at 900 s in a run of this round.
    let timeout = std::env::var("NUMAPIN_VM_TIMEOUT")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(Duration::from_secs(2100), Duration::from_secs);
    let mut failed = Vec::new();
    for (shape, cases) in &boots {
        let boot_started = Instant::now();
        let console_log = cache.join(match shape {
            Shape::FourNodes => "console.log".to_string(),
            _ => format!("console-{}.log", boot_name(*shape)),
        });
        let (console, seconds) = boot(&tools, *shape, &initramfs, &console_log, timeout)?;
        let mut outcomes = evaluate(&console, *shape, cases)?;
        for o in &mut outcomes {
            o.seconds = seconds.get(&o.binary).copied().unwrap_or(0.0);
        }
        report::print_table(&format!("test-numa ({})", shape.title()), &outcomes);
        println!(
            "test-numa: the {} boot took {:.0} s",
            boot_name(*shape),
            boot_started.elapsed().as_secs_f64()
        );
        if !report::all_ok(&outcomes) {
            failed.push(console_log.display().to_string());
        }
    }
    println!(
        "test-numa took {:.0} s in all",
        started.elapsed().as_secs_f64()
    );
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "test-numa: failures above (console: {})",
            failed.join(", ")
        ))
    }
}

/// The boot's name in `NUMAPIN_VM_BOOTS`, console file names and messages.
fn boot_name(shape: Shape) -> &'static str {
    shape.env().unwrap_or("four-nodes")
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

/// The steps of a VM boot; `NUMAPIN_VM_ONLY=name,...` keeps only those (for iterating on
/// one binary; CI runs all).
fn cases(shape: Shape, tests: &[TestBinary]) -> Vec<Case> {
    let mut cases = all_cases(shape, tests);
    if let Ok(only) = std::env::var("NUMAPIN_VM_ONLY") {
        let only: Vec<&str> = only.split(',').collect();
        cases.retain(|c| only.contains(&c.name.as_str()));
    }
    cases
}

fn all_cases(shape: Shape, tests: &[TestBinary]) -> Vec<Case> {
    let tests: Vec<&TestBinary> = tests
        .iter()
        .filter(|t| {
            shape
                .binaries()
                .is_none_or(|keep| keep.contains(&t.name.as_str()))
        })
        .collect();
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
        command: format!("/x/pin_model {}", shape.pin_model().0),
    });
    cases
}

fn init_script(boots: &[(Shape, Vec<Case>)], fixtures: bool, target_tmp: &Path) -> String {
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
    // Each node's free memory before the tests (the console's record of room per node:
    // a placement that finds a node full falls back to another).
    s += "grep -h MemFree $N/node*/meminfo\n";
    // Before each case, the room it starts with: free kB per node, shared memory, the
    // files the cases before it left in /tmp and in Cargo's CARGO_TARGET_TMPDIR (here
    // ramfs: memory on the node that wrote them, until removed), and processes alive.
    // Then those files go: a case's leftovers must not fill a node for the next one.
    s += &format!("TT={}\n", target_tmp.display());
    s += "room() { for f in $N/node*/meminfo; do awk '/MemFree/{printf \"%s \", $4}' $f; done; \
          echo \"shmem=$(awk '/Shmem:/{print $2}' /proc/meminfo) left=$(du -sk /tmp $TT 2>/dev/null | awk '{k+=$1} END {print k+0}') procs=$(ls -d /proc/[0-9]* | wc -l)\"; \
          rm -rf /tmp/* $TT/* 2>/dev/null; }\n";
    s += "export NUMAPIN_EXPECT=full NUMAPIN_TEST_NODES=4 RUST_BACKTRACE=1 TMPDIR=/tmp\n";
    s += "export NUMAPIN_BIN=/x/numapin\n";
    s += &format!("export NUMAPIN_FUZZ_CASES={VM_FUZZ_CASES}\n");
    s += &format!("export NUMAPIN_CACHE_OPS={VM_CACHE_OPS}\n");
    if fixtures {
        s += &format!("export NUMAPIN_FIXTURES={VM_FIXTURES}\n");
    }
    // Each boot's cases: the kernel command line sets NUMAPIN_VM_SHAPE (unset in the
    // first boot); the tests read it from the environment they inherit.
    s += "export NUMAPIN_VM_SHAPE\ncase \"$NUMAPIN_VM_SHAPE\" in\n";
    for (shape, cases) in boots {
        s += &format!("{})\n", shape.env().unwrap_or("''"));
        for case in cases {
            s += &format!(
                "echo \"{ROOM}{name} $(room)@@\"\necho \"{BEGIN}{name}@@\"\n{command} 2>&1\necho \"{END}{name} $?@@\"\n",
                name = case.name,
                command = case.command
            );
        }
        s += ";;\n";
    }
    s += "esac\n";
    s += &format!("echo \"{DONE}\"\npoweroff -f\n");
    s
}

fn build_initramfs(
    tools: &Tools,
    boots: &[(Shape, Vec<Case>)],
    tests: &[TestBinary],
    programs: &[(&str, &Path)],
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
        init_script(boots, fixtures.is_some(), &crate::target_dir()?.join("tmp")).as_bytes(),
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
    for (name, path) in programs {
        archive.file(&format!("/x/{name}"), &read(path)?, true);
        libraries.extend(shared_libraries(path)?);
    }
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
    shape: Shape,
    initramfs: &Path,
    log: &Path,
    timeout: Duration,
) -> Result<(String, BTreeMap<String, f64>), String> {
    let mut cmd = qemu_command(tools, shape, initramfs);
    eprintln!("xtask: booting {cmd:?}");
    let started = Instant::now();
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("{}: {e}", tools.qemu.display()))?;
    let lines = forward_output(&mut child)?;
    let mut console = Console::new(log, started)?;
    let outcome = console.follow(&lines, timeout);
    // poweroff -f follows DONE at once; give qemu a moment, then make sure it is gone.
    let stop_by = Instant::now() + Duration::from_secs(10);
    while Instant::now() < stop_by && child.try_wait().ok().flatten().is_none() {
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
    match outcome {
        Ok(()) => Ok((console.text, console.seconds)),
        Err(e) => {
            let tail: Vec<&str> = console.text.lines().rev().take(80).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            Err(format!(
                "{e}; console tail ({}):\n{}",
                log.display(),
                tail.join("\n")
            ))
        }
    }
}

/// qemu for one boot of `shape`: TCG, the kernel and the initramfs, the serial console
/// on stdout.
fn qemu_command(tools: &Tools, shape: Shape, initramfs: &Path) -> Command {
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
    ]);
    shape.qemu_args(&mut cmd);
    let mut append = String::from("console=ttyS0 rdinit=/init panic=-1 loglevel=4");
    if let Some(name) = shape.env() {
        append += &format!(" NUMAPIN_VM_SHAPE={name}");
    }
    cmd.arg("-kernel")
        .arg(&tools.kernel)
        .arg("-initrd")
        .arg(initramfs)
        .args(["-append", &append, "-serial", "stdio"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// qemu's stdout (the console) and stderr (marked `qemu: `) as one stream of lines, read
/// by a thread each so that neither pipe fills while the other is waited on.
fn forward_output(child: &mut std::process::Child) -> Result<mpsc::Receiver<String>, String> {
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
    Ok(rx)
}

/// The VM's console as it arrives: its text, a copy in the log file, when it booted, and
/// how long each case ran (from its BEGIN marker to its END).
struct Console {
    text: String,
    log_file: std::fs::File,
    started: Instant,
    booted: Option<Duration>,
    case_started: Option<(String, f64)>,
    seconds: BTreeMap<String, f64>,
}

impl Console {
    fn new(log: &Path, started: Instant) -> Result<Console, String> {
        let log_file = std::fs::File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
        Ok(Console {
            text: String::new(),
            log_file,
            started,
            booted: None,
            case_started: None,
            seconds: BTreeMap::new(),
        })
    }

    /// Reads lines until the run says DONE (`Ok`), the kernel panics, qemu exits, or
    /// `timeout` from the start passes.
    fn follow(&mut self, lines: &mpsc::Receiver<String>, timeout: Duration) -> Result<(), String> {
        let deadline = self.started + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match lines.recv_timeout(left) {
                Ok(line) => {
                    if let Some(end) = self.take(line) {
                        return end;
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    return Err(format!(
                        "the VM did not finish within {} s",
                        timeout.as_secs()
                    ));
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err("qemu exited before the test run finished".to_string());
                }
            }
        }
    }

    /// Logs and keeps one line, noting the boot and the cases' markers; `Some` once the
    /// line ends the run.
    fn take(&mut self, line: String) -> Option<Result<(), String>> {
        let _ = writeln!(self.log_file, "{line}");
        if line.starts_with(TOPOLOGY) && self.booted.is_none() {
            self.booted = Some(self.started.elapsed());
            eprintln!(
                "xtask: VM booted in {:.1} s: {line}",
                self.started.elapsed().as_secs_f64()
            );
        }
        let now = self.started.elapsed().as_secs_f64();
        if let Some(room) = line.strip_prefix(ROOM) {
            eprintln!(
                "xtask: [{now:>5.0} s] free kB per node, shmem kB, files left kB, processes before {}",
                room.trim_end_matches('@')
            );
        }
        if let Some(name) = line.strip_prefix(BEGIN) {
            let name = name.trim_end_matches('@').to_string();
            eprintln!("xtask: [{now:>5.0} s] {name}");
            self.case_started = Some((name, now));
        }
        if line.starts_with(END)
            && let Some((name, at)) = self.case_started.take()
        {
            self.seconds.insert(name, now - at);
        }
        let done = line.contains(DONE);
        let panic = line.contains("Kernel panic");
        self.text.push_str(&line);
        self.text.push('\n');
        if done {
            return Some(Ok(()));
        }
        if panic {
            return Some(Err("the VM kernel panicked".to_string()));
        }
        None
    }
}

/// Splits the console into cases and judges each.
fn evaluate(console: &str, shape: Shape, cases: &[Case]) -> Result<Vec<Outcome>, String> {
    let topology = console
        .lines()
        .find_map(|l| l.strip_prefix(TOPOLOGY))
        .ok_or("the VM printed no topology line")?;
    if !shape
        .expected_topology()
        .iter()
        .all(|want| topology.contains(want))
    {
        return Err(format!(
            "the VM's topology is not the one asked for: {topology}"
        ));
    }
    let mut outcomes = Vec::new();
    for case in cases {
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
        // The second boot exists for its binaries' shape-specific tests: one that says
        // it did not run there is a failure.
        let not_run = report::count_not_run(output);
        if shape.binaries().is_some() && case.name == "domains" && not_run > 0 {
            eprintln!(
                "{}: {not_run} tests did not run in the {} boot",
                case.name,
                boot_name(shape)
            );
            failed += not_run;
            ok = false;
        }
        if case.name == "pin_model" {
            match check_pin_model(output, shape.pin_model().1) {
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
            not_run,
            seconds: 0.0,
        });
    }
    Ok(outcomes)
}

/// The main job's JSON must show bound pages on `nodes` memory nodes (all of them).
fn check_pin_model(output: &str, want_nodes: usize) -> Result<(), String> {
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
    if with_pages < want_nodes || !json.contains("\"placement\":\"bound\"") {
        return Err(format!(
            "expected bound pages on {want_nodes} nodes, got {pages:?} in {json}"
        ));
    }
    println!("pin_model in the VM: pages per node {{{pages}}}");
    Ok(())
}
