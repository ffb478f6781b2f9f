//! `cargo xtask test-container`: the test binaries again in unshared user, mount and pid
//! namespaces, plain and under seccomp filters that answer the NUMA syscalls the way a
//! default Docker profile (EPERM), Docker with `--cap-add SYS_NICE` (EPERM for the page
//! calls only) or a kernel without NUMA (ENOSYS) does.
//!
//! The xtask re-executes itself as `__sandbox <env> <binary>`: that process unshares the
//! namespaces, maps root to the caller, forks so the child is pid 1 of the new pid
//! namespace, mounts a fresh /proc there, installs the filter (after
//! `PR_SET_NO_NEW_PRIVS`, which seccompiler sets) and execs the binary.
//!
//! `docker-sys-nice` run as root skips the user namespace (whose CAP_SYS_NICE the kernel
//! would not honour for `MPOL_MF_MOVE_ALL`) and instead drops every capability but
//! CAP_SYS_NICE from all sets, the bounding set included, so the exec'd binary keeps
//! only that one (`docker run --cap-add SYS_NICE` keeps Docker's default set as well).
//! Unprivileged it runs in a user namespace like the others and models only the seccomp
//! half.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Instant;

use seccompiler::{BpfProgram, SeccompAction, SeccompFilter, TargetArch};

use crate::binaries;
use crate::report::{self, Outcome};

pub const SANDBOX: &str = "__sandbox";

/// One environment of the matrix.
struct Env {
    name: &'static str,
    expect: &'static str,
    /// The errno the `filtered` syscalls get; `None`: no filter.
    errno: Option<i32>,
    /// The syscalls the filter answers.
    filtered: &'static [i64],
    /// As root: no user namespace, every capability but CAP_SYS_NICE dropped.
    sys_nice_only: bool,
    what: &'static str,
}

const ENVS: [Env; 4] = [
    Env {
        name: "userns",
        expect: "full",
        errno: None,
        filtered: &[],
        sys_nice_only: false,
        what: "namespaces only: placement works; MOVE_ALL lacks CAP_SYS_NICE on the host",
    },
    Env {
        name: "docker-default",
        expect: "denied",
        errno: Some(libc::EPERM),
        filtered: &DOCKER_DEFAULT,
        sys_nice_only: false,
        what: "seccomp answers the NUMA and io_uring syscalls with EPERM (Docker's default \
               profile)",
    },
    Env {
        name: "docker-sys-nice",
        expect: "sys-nice",
        errno: Some(libc::EPERM),
        filtered: &DOCKER_SYS_NICE,
        sys_nice_only: true,
        what: "seccomp answers move_pages, migrate_pages and io_uring with EPERM, the policy \
               calls work (Docker's default profile with --cap-add SYS_NICE)",
    },
    Env {
        name: "no-numa",
        expect: "unsupported",
        errno: Some(libc::ENOSYS),
        filtered: &NO_NUMA,
        sys_nice_only: false,
        what: "seccomp answers the NUMA and io_uring syscalls with ENOSYS (CONFIG_NUMA=n, \
               CONFIG_IO_URING=n)",
    },
];

/// The syscalls Docker's default profile denies without CAP_SYS_NICE, and that a kernel
/// without NUMA does not implement.
const NUMA_SYSCALLS: [i64; 6] = [
    libc::SYS_mbind,
    libc::SYS_set_mempolicy,
    libc::SYS_get_mempolicy,
    450, // set_mempolicy_home_node (x86-64)
    libc::SYS_move_pages,
    libc::SYS_migrate_pages,
];

/// The syscalls in none of the profile's allow lists: EPERM (its default errno) whatever
/// the capabilities.
const PAGE_SYSCALLS: [i64; 2] = [libc::SYS_move_pages, libc::SYS_migrate_pages];

/// io_uring: out of Docker's default profile since Docker 25 (moby #46762), so EPERM;
/// ENOSYS where the kernel is built without it. numapin's direct reads fall back to
/// blocking reads on the loader threads and say so (tests/direct_io.rs).
const IO_URING_SYSCALLS: [i64; 3] = [
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
];

/// `a` then `b`, at compile time.
const fn both<const A: usize, const B: usize, const N: usize>(
    a: [i64; A],
    b: [i64; B],
) -> [i64; N] {
    assert!(A + B == N, "both: the lengths do not add up");
    let mut out = [0i64; N];
    let mut i = 0;
    while i < A {
        out[i] = a[i];
        i += 1;
    }
    while i < N {
        out[i] = b[i - A];
        i += 1;
    }
    out
}

const DOCKER_DEFAULT: [i64; 9] = both(NUMA_SYSCALLS, IO_URING_SYSCALLS);
const DOCKER_SYS_NICE: [i64; 5] = both(PAGE_SYSCALLS, IO_URING_SYSCALLS);
const NO_NUMA: [i64; 9] = both(NUMA_SYSCALLS, IO_URING_SYSCALLS);

/// What `cargo xtask test-container` was asked: one environment or all, how many rounds.
struct Request {
    only: Option<String>,
    repeat: usize,
}

const CONTAINER_USAGE: &str = "usage: cargo xtask test-container \
     [--env userns|docker-default|docker-sys-nice|no-numa] [--repeat N]";

fn parse_request(args: &[String]) -> Result<Request, String> {
    let mut request = Request {
        only: None,
        repeat: 1,
    };
    let mut args = args.iter();
    while let Some(flag) = args.next() {
        let value = args
            .next()
            .ok_or_else(|| format!("{flag} needs a value\n{CONTAINER_USAGE}"))?;
        match flag.as_str() {
            "--env" => request.only = Some(value.clone()),
            "--repeat" => {
                request.repeat = value
                    .parse()
                    .ok()
                    .filter(|&n| n >= 1)
                    .ok_or_else(|| format!("--repeat {value:?}: a count of at least 1"))?
            }
            _ => return Err(format!("unknown flag {flag:?}\n{CONTAINER_USAGE}")),
        }
    }
    Ok(request)
}

/// Runs the environments (`--env` one of them) `--repeat` times over (default once), each
/// round in full whatever the last one gave, and fails if any round failed: a flaky test
/// is a failing test. The rounds' verdicts end the output.
pub fn run(args: &[String]) -> Result<(), String> {
    let request = parse_request(args)?;
    let envs: Vec<&Env> = ENVS
        .iter()
        .filter(|e| request.only.as_deref().is_none_or(|o| o == e.name))
        .collect();
    if envs.is_empty() {
        return Err(format!("unknown environment {:?}", request.only));
    }
    check_userns()?;
    // Release binaries: the ones `test-numa` boots with, so `cargo xtask test` builds the
    // package's tests once for both stages (the host stage's debug build is the
    // workspace's, whose unified features differ), and they run faster here too.
    let mut tests = binaries::build(true)?;
    // The Python suite too, where `test-python` (or `test`) installed the package.
    match crate::python::installed() {
        Some(python) => tests.push(binaries::TestBinary {
            name: "pytest python-tests".into(),
            path: python,
            args: crate::python::pytest_args(),
        }),
        None => eprintln!(
            "xtask: NOT RUN: the Python suite (`cargo xtask test-python` installs the \
             package; `cargo xtask test` always does)"
        ),
    }
    let mut verdicts = Vec::new();
    for round in 1..=request.repeat {
        if request.repeat > 1 {
            eprintln!("xtask: test-container round {round} of {}", request.repeat);
        }
        let start = Instant::now();
        let ok = run_round(&envs, &tests)?;
        verdicts.push((ok, start.elapsed().as_secs_f64()));
    }
    if request.repeat > 1 {
        for (round, (ok, seconds)) in verdicts.iter().enumerate() {
            eprintln!(
                "xtask: test-container round {}: {} in {seconds:.0} s",
                round + 1,
                if *ok { "passed" } else { "FAILED" }
            );
        }
    }
    let passed = verdicts.iter().filter(|(ok, _)| *ok).count();
    eprintln!(
        "xtask: test-container: {passed} of {} rounds passed",
        verdicts.len()
    );
    if passed == verdicts.len() {
        Ok(())
    } else {
        Err("test-container: failures above".into())
    }
}

/// One round: every test binary in every environment; whether all passed.
fn run_round(envs: &[&Env], tests: &[binaries::TestBinary]) -> Result<bool, String> {
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let logs = crate::target_dir()?.join("xtask/container");
    // The fixtures live under the target directory, which the sandbox sees as the host
    // does (only /proc is remounted there).
    let fixtures = crate::fixtures::existing();
    std::fs::create_dir_all(&logs).map_err(|e| format!("{}: {e}", logs.display()))?;

    let mut outcomes = Vec::new();
    for env in envs {
        eprintln!("xtask: environment {}: {}", env.name, env.what);
        if env.sys_nice_only {
            eprintln!(
                "xtask: {}",
                if is_root() {
                    "as root: no user namespace; every capability but CAP_SYS_NICE dropped"
                } else {
                    "unprivileged: in a user namespace, so this models only the seccomp half \
                     (CAP_SYS_NICE there does not reach host pages: MOVE_ALL still fails)"
                }
            );
        }
        for test in tests {
            let log = logs.join(format!(
                "{}-{}.log",
                env.name,
                test.name.replace([' ', '(', ')'], "")
            ));
            let file =
                std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
            let err = file.try_clone().map_err(|e| e.to_string())?;
            let start = Instant::now();
            let mut command = Command::new(&exe);
            if let Some(dir) = &fixtures {
                command.env("NUMAPIN_FIXTURES", dir);
            }
            let status = command
                .args([SANDBOX, env.name])
                .arg(&test.path)
                .args(&test.args)
                .env("NUMAPIN_EXPECT", env.expect)
                // The randomized cache test: a tenth of the host's operations.
                .env("NUMAPIN_CACHE_OPS", "100000")
                .env_remove("NUMAPIN_TEST_NODES")
                .stdin(Stdio::null())
                .stdout(file)
                .stderr(err)
                .status()
                .map_err(|e| format!("{}: {e}", exe.display()))?;
            let output = std::fs::read_to_string(&log).unwrap_or_default();
            let (passed, failed) = report::parse_counts(&output);
            let outcome = Outcome {
                env: env.name.into(),
                binary: test.name.clone(),
                passed,
                failed,
                ok: status.success(),
                not_run: report::count_not_run(&output),
                seconds: start.elapsed().as_secs_f64(),
            };
            if !outcome.ok || failed > 0 {
                eprintln!(
                    "--- {} in {} failed ({status}); log {}:",
                    test.name,
                    env.name,
                    log.display()
                );
                let tail: Vec<&str> = output.lines().rev().take(60).collect();
                tail.iter().rev().for_each(|l| eprintln!("  {l}"));
            }
            outcomes.push(outcome);
        }
    }
    report::print_table("test-container", &outcomes);
    Ok(report::all_ok(&outcomes))
}

/// Unprivileged user namespaces must work, or nothing here can.
fn check_userns() -> Result<(), String> {
    let status = Command::new("unshare")
        .args(["--user", "--map-root-user", "true"])
        .status();
    match status {
        Ok(s) if s.success() => Ok(()),
        Ok(s) => Err(format!(
            "user namespaces are unavailable here (`unshare --user --map-root-user true`: {s}); \
             enable them with `sysctl -w kernel.unprivileged_userns_clone=1` or \
             `sysctl -w user.max_user_namespaces=15000`"
        )),
        // No unshare(1): try the syscall in the sandbox itself, which reports its own error.
        Err(_) => Ok(()),
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() == 0 }
}

fn filter(errno: i32, syscalls: &[i64]) -> Result<BpfProgram, String> {
    let rules: BTreeMap<i64, Vec<seccompiler::SeccompRule>> =
        syscalls.iter().map(|&nr| (nr, Vec::new())).collect();
    SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(errno as u32),
        TargetArch::x86_64,
    )
    .and_then(BpfProgram::try_from)
    .map_err(|e| format!("building the seccomp filter: {e}"))
}

fn write_file(path: &str, text: &str) -> Result<(), String> {
    std::fs::write(path, text).map_err(|e| format!("write {path} ({text:?}): {e}"))
}

fn os_error(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

/// `__sandbox <env> <binary> [args...]`: runs in the process the xtask spawned.
pub fn sandbox(args: &[String]) -> Result<(), String> {
    let [env_name, binary, rest @ ..] = args else {
        return Err(format!("usage: xtask {SANDBOX} <env> <binary> [args]"));
    };
    let env = ENVS
        .iter()
        .find(|e| e.name == env_name)
        .ok_or_else(|| format!("unknown environment {env_name}"))?;
    let program = filter_for(env)?;
    // As root, the CAP_SYS_NICE environment keeps the initial user namespace, where that
    // capability is real; the others (and it, unprivileged) get one of their own.
    let sys_nice_only = env.sys_nice_only && is_root();
    if sys_nice_only {
        // SAFETY: unshare only changes this process's namespaces.
        if unsafe { libc::unshare(libc::CLONE_NEWNS | libc::CLONE_NEWPID) } != 0 {
            return Err(os_error("unshare(CLONE_NEWNS | CLONE_NEWPID)"));
        }
    } else {
        // SAFETY: plain syscalls on this process; getuid/getgid cannot fail.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        // SAFETY: unshare only changes this process's namespaces.
        if unsafe { libc::unshare(libc::CLONE_NEWUSER | libc::CLONE_NEWNS | libc::CLONE_NEWPID) }
            != 0
        {
            return Err(os_error(
                "unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID)",
            ));
        }
        write_file("/proc/self/setgroups", "deny")?;
        write_file("/proc/self/uid_map", &format!("0 {uid} 1"))?;
        write_file("/proc/self/gid_map", &format!("0 {gid} 1"))?;
    }

    // SAFETY: this process is single-threaded here (the xtask main thread only), so the
    // child may allocate and exec freely.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(os_error("fork"));
    }
    if pid > 0 {
        let mut status = 0;
        // SAFETY: waiting for our own child.
        if unsafe { libc::waitpid(pid, &mut status, 0) } < 0 {
            return Err(os_error("waitpid"));
        }
        let code = if libc::WIFEXITED(status) {
            libc::WEXITSTATUS(status)
        } else {
            128 + libc::WTERMSIG(status)
        };
        std::process::exit(code);
    }
    // The child: pid 1 of the new pid namespace.
    let result = enter_and_exec(program.as_ref(), sys_nice_only, binary, rest);
    eprintln!("xtask sandbox: {}", result.unwrap_err());
    std::process::exit(127);
}

fn filter_for(env: &Env) -> Result<Option<BpfProgram>, String> {
    env.errno.map(|e| filter(e, env.filtered)).transpose()
}

/// Drops every capability but CAP_SYS_NICE from the bounding, inheritable, ambient,
/// permitted and effective sets. Root's exec then grants the bounding set's
/// intersection with a full file set (see capabilities(7)): CAP_SYS_NICE alone.
fn keep_only_cap_sys_nice() -> Result<(), String> {
    use caps::{CapSet, Capability};
    let err = |what: &str, e: caps::errors::CapsError| format!("{what}: {e}");
    let bounding = caps::read(None, CapSet::Bounding).map_err(|e| err("read bounding set", e))?;
    for cap in bounding {
        if cap != Capability::CAP_SYS_NICE {
            caps::drop(None, CapSet::Bounding, cap).map_err(|e| err("drop from bounding", e))?;
        }
    }
    caps::clear(None, CapSet::Ambient).map_err(|e| err("clear ambient set", e))?;
    caps::clear(None, CapSet::Inheritable).map_err(|e| err("clear inheritable set", e))?;
    let only: caps::CapsHashSet = std::iter::once(Capability::CAP_SYS_NICE).collect();
    caps::set(None, CapSet::Effective, &only).map_err(|e| err("set effective set", e))?;
    caps::set(None, CapSet::Permitted, &only).map_err(|e| err("set permitted set", e))?;
    Ok(())
}

fn enter_and_exec(
    program: Option<&BpfProgram>,
    sys_nice_only: bool,
    binary: &str,
    args: &[String],
) -> Result<(), String> {
    let c = |s: &str| CString::new(s).map_err(|e| e.to_string());
    let (none, root, proc_) = (c("none")?, c("/")?, c("/proc")?);
    // SAFETY: valid C strings; the mount namespace is our own.
    unsafe {
        if libc::mount(
            none.as_ptr(),
            root.as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        ) != 0
        {
            return Err(os_error("mount --make-rprivate /"));
        }
        let proc_type = c("proc")?;
        if libc::mount(
            proc_type.as_ptr(),
            proc_.as_ptr(),
            proc_type.as_ptr(),
            0,
            std::ptr::null(),
        ) != 0
        {
            return Err(os_error("mount proc /proc"));
        }
    }
    if sys_nice_only {
        keep_only_cap_sys_nice()?;
    }
    if let Some(program) = program {
        seccompiler::apply_filter(program)
            .map_err(|e| format!("installing the seccomp filter: {e}"))?;
    }
    let err = Command::new(PathBuf::from(binary)).args(args).exec();
    Err(format!("exec {binary}: {err}"))
}
