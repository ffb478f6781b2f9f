//! `numapin`: probe, plan, place, stat (docs/cli.md). The code is the library's
//! `numapin::cli`, which the Python package's console script and the pin_model example
//! call too.

#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOCATOR: numapin::jemalloc::Jemalloc = numapin::jemalloc::Jemalloc;

#[cfg(feature = "jemalloc")]
#[allow(non_upper_case_globals)]
#[unsafe(export_name = "_rjem_malloc_conf")]
pub static malloc_conf: &[u8; 13] = b"retain:false\0";

fn main() -> std::process::ExitCode {
    let status = numapin::cli::main(std::env::args_os());
    std::process::ExitCode::from(u8::try_from(status).unwrap_or(1))
}
