//! A store served by name: readers in other processes fetch it over the socket, attach
//! and read every byte; they outlive the server and re-serve; one placer wins a race;
//! a killed reader leaks nothing; other uids are refused both ways.

mod serve_common;

use std::io::{BufReader, Write};
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use numapin::ServeFault;
use numapin::serve::{self, Access, Endpoint, Joined, Limits, Server};
use serve_common::*;

fn limits() -> Limits {
    Limits::default().timeout(Duration::from_secs(20))
}

#[test]
fn four_readers_fetch_attach_and_read_every_byte() {
    let mut store = store();
    let name = unique("four");
    let server = Server::bind(&name, parcel(&mut store), Access::same_uid()).unwrap();
    let children: Vec<_> = (0..4)
        .map(|_| spawn("child_reader", &[("SERVE_NAME", &name)]))
        .collect();
    for c in children {
        let out = c.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{text}");
        assert!(
            text.contains(&format!("READ bytes={TOTAL} private=0")),
            "{text}"
        );
    }
    let stats = settle(&server, 4);
    assert_eq!((stats.served, stats.refused), (4, 0));
}

/// Fetches, attaches, checks every byte; then, when the parent writes a line (or at
/// once without `SERVE_HOLD`), checks again, and with `SERVE_RESERVE` serves what it
/// holds until stdin closes.
#[test]
#[ignore = "a child process of the serve tests"]
fn child_reader() {
    let name = var("SERVE_NAME");
    let parcel = serve::fetch(&name, &limits()).unwrap();
    let held = parcel.try_clone().unwrap();
    // Sealed: this reader can neither write, shrink nor grow what the others read.
    let file = &parcel.files[0];
    let len = file.metadata().unwrap().len();
    let eperm = Some(libc::EPERM);
    assert_eq!(file.write_at(&[0], 0).unwrap_err().raw_os_error(), eperm);
    assert_eq!(file.set_len(0).unwrap_err().raw_os_error(), eperm);
    assert_eq!(file.set_len(len + 4096).unwrap_err().raw_os_error(), eperm);
    let store = attach(parcel);
    let bytes = check(&store);
    let stats = store.stats().unwrap();
    println!("READ bytes={bytes} private={}", stats.private_bytes);
    if std::env::var_os("SERVE_HOLD").is_none() {
        return;
    }
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    println!("REREAD bytes={}", check(&store));
    if std::env::var_os("SERVE_RESERVE").is_some() {
        let server = Server::bind(&name, held, Access::same_uid()).unwrap();
        println!("RESERVED {}", server.address());
        std::io::stdin().read_line(&mut line).unwrap();
    }
}

/// Places and serves until killed.
#[test]
#[ignore = "a child process of the serve tests"]
fn child_server() {
    let mut store = store();
    let _server = Server::bind(&var("SERVE_NAME"), parcel(&mut store), Access::same_uid()).unwrap();
    println!("SERVING");
    std::thread::sleep(Duration::from_secs(120));
}

#[test]
fn readers_outlive_a_killed_server_and_serve_again() {
    let name = unique("killed");
    let mut server = spawn("child_server", &[("SERVE_NAME", &name)]);
    wait_line(
        &mut BufReader::new(server.stdout.take().unwrap()),
        "SERVING",
    );
    let env = [("SERVE_NAME", name.as_str()), ("SERVE_HOLD", "1")];
    let mut a = spawn("child_reader", &env);
    let mut b = spawn("child_reader", &[env[0], env[1], ("SERVE_RESERVE", "1")]);
    let mut a_out = BufReader::new(a.stdout.take().unwrap());
    let mut b_out = BufReader::new(b.stdout.take().unwrap());
    let full = format!("READ bytes={TOTAL}");
    assert!(wait_line(&mut a_out, "READ").starts_with(&full));
    assert!(wait_line(&mut b_out, "READ").starts_with(&full));
    server.kill().unwrap();
    server.wait().unwrap();
    // The name is not served any more; the readers still read every byte.
    let gone = serve::fetch(&name, &limits()).unwrap_err();
    assert_eq!(gone.serve_fault(), Some(ServeFault::NotServed), "{gone}");
    for (child, out) in [(&mut a, &mut a_out), (&mut b, &mut b_out)] {
        writeln!(child.stdin.as_mut().unwrap()).unwrap();
        assert_eq!(wait_line(out, "REREAD"), format!("REREAD bytes={TOTAL}"));
    }
    // Reader b serves what it holds: a new process attaches from it.
    wait_line(&mut b_out, "RESERVED");
    let store = attach(serve::fetch(&name, &limits()).unwrap());
    assert_eq!(check(&store), TOTAL);
    drop(b.stdin.take());
    assert!(a.wait().unwrap().success());
    assert!(b.wait().unwrap().success());
}

#[test]
fn one_of_four_racing_processes_places_and_the_others_attach() {
    let name = unique("race");
    let children: Vec<_> = (0..4)
        .map(|_| spawn("child_join", &[("SERVE_NAME", &name)]))
        .collect();
    let mut placed = 0;
    let mut attached = 0;
    for c in children {
        let out = c.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{text}");
        assert!(text.contains(&format!("bytes={TOTAL}")), "{text}");
        placed += text.matches("PLACED").count();
        attached += text.matches("ATTACHED").count();
    }
    assert_eq!((placed, attached), (1, 3));
}

/// Joins the name: places (and serves until the 3 others fetched) or attaches.
#[test]
#[ignore = "a child process of the serve tests"]
fn child_join() {
    let name = var("SERVE_NAME");
    let joined = serve::serve_or_attach(&name, Access::same_uid(), &limits(), || {
        let mut s = store();
        let p = parcel(&mut s);
        Ok((s, p))
    })
    .unwrap();
    match joined {
        Joined::Placed { value, server } => {
            println!("PLACED bytes={}", check(&value));
            let deadline = Instant::now() + Duration::from_secs(60);
            while server.stats().served < 3 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Joined::Attached(parcel) => println!("ATTACHED bytes={}", check(&attach(parcel))),
    }
}

#[test]
fn a_reader_killed_mid_fetch_leaks_no_fd_in_the_server() {
    let out = spawn("child_leak", &[]).wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("LEAK-CHECKED"), "{text}");
}

/// Alone in its process, so that its fd counts are exact: a server, readers killed
/// after connecting (before reading), one that reads, then the same count of fds.
#[test]
#[ignore = "a child process of the serve tests"]
fn child_leak() {
    let mut store = store();
    let name = unique("leak");
    let server = Server::bind(&name, parcel(&mut store), Access::same_uid()).unwrap();
    let before = fd_count();
    for _ in 0..3 {
        let mut c = spawn("child_stall", &[("SERVE_NAME", &name)]);
        wait_line(&mut BufReader::new(c.stdout.take().unwrap()), "CONNECTED");
        c.kill().unwrap();
        c.wait().unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let handled = |s: &Server| s.stats().served + s.stats().failed;
    while handled(&server) < 3 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(handled(&server), 3);
    let fetched = serve::fetch(&name, &limits()).unwrap();
    assert_eq!(check(&attach(fetched)), TOTAL);
    assert_eq!(fd_count(), before, "fds of the server before and after");
    println!("LEAK-CHECKED");
}

/// Connects to the name and stops there, as a reader killed mid-fetch.
#[test]
#[ignore = "a child process of the serve tests"]
fn child_stall() {
    let addr = serve::address(&var("SERVE_NAME"), &Endpoint::Abstract, 0).unwrap();
    let sock = connect_abstract(&addr);
    println!("CONNECTED");
    std::thread::sleep(Duration::from_secs(60));
    drop(sock);
}

fn connect_abstract(addr: &str) -> std::os::fd::OwnedFd {
    use rustix::net::*;
    let name = addr.strip_prefix('@').unwrap();
    let sock = socket(AddressFamily::UNIX, SocketType::STREAM, None).unwrap();
    connect(
        &sock,
        &SocketAddrUnix::new_abstract_name(name.as_bytes()).unwrap(),
    )
    .unwrap();
    sock
}

fn root(test: &str) -> bool {
    // A child can become nobody when we are root with CAP_SETUID and CAP_SETGID and
    // 65534 is mapped in our user namespace (a container sandbox may have neither).
    let mapped = |file: &str| {
        std::fs::read_to_string(file).is_ok_and(|map| {
            map.lines().any(|l| {
                let f: Vec<u64> = l
                    .split_whitespace()
                    .filter_map(|w| w.parse().ok())
                    .collect();
                f.len() == 3 && (f[0]..f[0].saturating_add(f[2])).contains(&65534)
            })
        })
    };
    let cap = |c| caps::has_cap(None, caps::CapSet::Effective, c).unwrap_or(false);
    let can = rustix::process::geteuid().is_root()
        && cap(caps::Capability::CAP_SETUID)
        && cap(caps::Capability::CAP_SETGID)
        && mapped("/proc/self/uid_map")
        && mapped("/proc/self/gid_map");
    if !can {
        println!(
            "{test}: NOT RUN: a child cannot become nobody (65534) here: needs root with \
             CAP_SETUID/CAP_SETGID and 65534 mapped in the user namespace"
        );
    }
    can
}

#[test]
fn a_peer_of_another_uid_is_refused_unless_allowed() {
    if !root("a_peer_of_another_uid_is_refused_unless_allowed") {
        return;
    }
    let mut store = store();
    let name = unique("uid");
    let server = Server::bind(&name, parcel(&mut store), Access::same_uid()).unwrap();
    let out = spawn("child_nobody", &[("SERVE_NAME", &name)])
        .wait_with_output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("FAULT Some(Closed)"), "{text}");
    let stats = settle(&server, 1);
    assert_eq!((stats.served, stats.refused), (0, 1));
    drop(server);
    let name = unique("allowed");
    let server = Server::bind(&name, parcel(&mut store), Access::allow([65534])).unwrap();
    let out = spawn("child_nobody", &[("SERVE_NAME", &name)])
        .wait_with_output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&format!("READ bytes={TOTAL}")), "{text}");
    assert_eq!(settle(&server, 1).served, 1);
}

/// As nobody: fetches root's name; prints the fault, or reads every byte.
#[test]
#[ignore = "a child process of the serve tests"]
fn child_nobody() {
    become_nobody();
    let limits = limits().owner(0);
    match serve::fetch(&var("SERVE_NAME"), &limits) {
        Ok(p) => println!("READ bytes={}", check(&attach(p))),
        Err(e) => println!("FAULT {:?} {e}", e.serve_fault()),
    }
}

fn become_nobody() {
    // SAFETY: plain syscalls on this single-threaded child's credentials (the test
    // harness runs it with --test-threads=1).
    let (g, u) = unsafe { (libc::setgid(65534), libc::setuid(65534)) };
    assert_eq!((g, u), (0, 0), "setgid/setuid to nobody");
}

#[test]
fn a_name_squatted_by_another_uid_is_refused() {
    if !root("a_name_squatted_by_another_uid_is_refused") {
        return;
    }
    let name = unique("squat");
    let mut c = spawn("child_squatter", &[("SERVE_NAME", &name)]);
    wait_line(&mut BufReader::new(c.stdout.take().unwrap()), "LISTENING");
    let e = serve::fetch(&name, &limits()).unwrap_err();
    c.kill().unwrap();
    c.wait().unwrap();
    assert_eq!(e.serve_fault(), Some(ServeFault::PeerUid), "{e}");
    assert!(e.to_string().contains("uid 65534"), "{e}");
}

/// As nobody: listens on root's abstract name for `SERVE_NAME`.
#[test]
#[ignore = "a child process of the serve tests"]
fn child_squatter() {
    use rustix::net::*;
    let addr = serve::address(&var("SERVE_NAME"), &Endpoint::Abstract, 0).unwrap();
    become_nobody();
    let sock = socket(AddressFamily::UNIX, SocketType::STREAM, None).unwrap();
    let name = addr.strip_prefix('@').unwrap().as_bytes();
    bind(&sock, &SocketAddrUnix::new_abstract_name(name).unwrap()).unwrap();
    listen(&sock, 8).unwrap();
    println!("LISTENING");
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
fn when_the_placer_fails_a_waiter_places_instead() {
    let name = unique("fail");
    let (placing_tx, placing_rx) = std::sync::mpsc::channel();
    let first = {
        let name = name.clone();
        std::thread::spawn(move || {
            serve::serve_or_attach(&name, Access::same_uid(), &limits(), || {
                placing_tx.send(()).unwrap();
                std::thread::sleep(Duration::from_millis(300));
                // Any error: a bad node string stands for a failed placement.
                let failed = numapin::NodeSet::parse("not-a-node").unwrap_err();
                Err::<(numapin::store::PinStore, serve::Parcel), _>(failed)
            })
        })
    };
    placing_rx.recv().unwrap();
    // The name is taken while the first places: this one waits, sees it fail, places.
    let joined = serve::serve_or_attach(&name, Access::same_uid(), &limits(), || {
        let mut s = store();
        let p = parcel(&mut s);
        Ok((s, p))
    })
    .unwrap();
    let Joined::Placed { value, server } = joined else {
        panic!("the waiter attached to a placer that failed")
    };
    assert!(first.join().unwrap().is_err());
    assert_eq!(check(&value), TOTAL);
    assert_eq!(
        check(&attach(serve::fetch(&name, &limits()).unwrap())),
        TOTAL
    );
    assert_eq!(settle(&server, 1).served, 1);
}

#[test]
fn a_store_serves_itself_and_attaches_by_name() {
    let mut store = store();
    let name = unique("store");
    let server = store.serve(&name, Access::same_uid()).unwrap();
    let attached = numapin::store::PinStore::attach_served(&name, &limits()).unwrap();
    assert_eq!(check(&attached), TOTAL);
    assert_eq!(check(&store), TOTAL);
    assert_eq!(settle(&server, 1).served, 1);
    let garbled = serve::Parcel {
        manifest: vec![0xff, 0xfe],
        files: vec![],
    };
    let e = numapin::store::PinStore::attach_parcel(garbled).unwrap_err();
    assert!(e.to_string().contains("not UTF-8"), "{e}");
}
