//! `cargo xtask test-container`: the test binaries again in unshared user, mount and pid
//! namespaces, plain and under seccomp filters that answer the NUMA syscalls the way a
//! default Docker profile (EPERM) or a kernel without NUMA (ENOSYS) does.
//!
//! The xtask re-executes itself as `__sandbox <env> <binary>`: that process unshares the
//! namespaces, maps root to the caller, forks so the child is pid 1 of the new pid
//! namespace, mounts a fresh /proc there, installs the filter (after
//! `PR_SET_NO_NEW_PRIVS`, which seccompiler sets) and execs the binary.

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
    /// The errno the NUMA syscalls get; `None`: no filter.
    errno: Option<i32>,
    what: &'static str,
}

const ENVS: [Env; 3] = [
    Env {
        name: "userns",
        expect: "full",
        errno: None,
        what: "namespaces only: placement works; MOVE_ALL lacks CAP_SYS_NICE on the host",
    },
    Env {
        name: "docker-default",
        expect: "denied",
        errno: Some(libc::EPERM),
        what: "seccomp answers the NUMA syscalls with EPERM (Docker's default profile)",
    },
    Env {
        name: "no-numa",
        expect: "unsupported",
        errno: Some(libc::ENOSYS),
        what: "seccomp answers the NUMA syscalls with ENOSYS (CONFIG_NUMA=n)",
    },
];

/// The syscalls Docker's default profile gates behind CAP_SYS_NICE, and that a kernel
/// without NUMA does not implement.
const NUMA_SYSCALLS: [i64; 6] = [
    libc::SYS_mbind,
    libc::SYS_set_mempolicy,
    libc::SYS_get_mempolicy,
    450, // set_mempolicy_home_node (x86-64)
    libc::SYS_move_pages,
    libc::SYS_migrate_pages,
];

pub fn run(args: &[String]) -> Result<(), String> {
    let only = match args {
        [] => None,
        [flag, name] if flag == "--env" => Some(name.as_str()),
        _ => {
            return Err(
                "usage: cargo xtask test-container [--env userns|docker-default|no-numa]".into(),
            );
        }
    };
    let envs: Vec<&Env> = ENVS
        .iter()
        .filter(|e| only.is_none_or(|o| o == e.name))
        .collect();
    if envs.is_empty() {
        return Err(format!("unknown environment {only:?}"));
    }
    check_userns()?;
    let tests = binaries::build(false)?;
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let logs = crate::target_dir()?.join("xtask/container");
    std::fs::create_dir_all(&logs).map_err(|e| format!("{}: {e}", logs.display()))?;

    let mut outcomes = Vec::new();
    for env in envs {
        eprintln!("xtask: environment {}: {}", env.name, env.what);
        for test in &tests {
            let log = logs.join(format!(
                "{}-{}.log",
                env.name,
                test.name.replace([' ', '(', ')'], "")
            ));
            let file =
                std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
            let err = file.try_clone().map_err(|e| e.to_string())?;
            let start = Instant::now();
            let status = Command::new(&exe)
                .args([SANDBOX, env.name])
                .arg(&test.path)
                .env("NUMAPIN_EXPECT", env.expect)
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
    if report::all_ok(&outcomes) {
        Ok(())
    } else {
        Err("test-container: failures above".into())
    }
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

fn filter(errno: i32) -> Result<BpfProgram, String> {
    let rules: BTreeMap<i64, Vec<seccompiler::SeccompRule>> =
        NUMA_SYSCALLS.iter().map(|&nr| (nr, Vec::new())).collect();
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
    // SAFETY: plain syscalls on this process; getuid/getgid cannot fail.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    // SAFETY: unshare only changes this process's namespaces.
    if unsafe { libc::unshare(libc::CLONE_NEWUSER | libc::CLONE_NEWNS | libc::CLONE_NEWPID) } != 0 {
        return Err(os_error(
            "unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID)",
        ));
    }
    write_file("/proc/self/setgroups", "deny")?;
    write_file("/proc/self/uid_map", &format!("0 {uid} 1"))?;
    write_file("/proc/self/gid_map", &format!("0 {gid} 1"))?;

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
    let result = enter_and_exec(program.as_ref(), binary, rest);
    eprintln!("xtask sandbox: {}", result.unwrap_err());
    std::process::exit(127);
}

fn filter_for(env: &Env) -> Result<Option<BpfProgram>, String> {
    env.errno.map(filter).transpose()
}

fn enter_and_exec(
    program: Option<&BpfProgram>,
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
    if let Some(program) = program {
        seccompiler::apply_filter(program)
            .map_err(|e| format!("installing the seccomp filter: {e}"))?;
    }
    let err = Command::new(PathBuf::from(binary)).args(args).exec();
    Err(format!("exec {binary}: {err}"))
}
