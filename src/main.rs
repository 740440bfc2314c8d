//! Thin entry point: parse arguments, call the library, map results to exit codes
//! (0 clean, 1 findings, 2 unusable input).

use clap::Parser;
use nvfp4_probe::cli::Cli;

fn main() {
    // A closed pipe (`nvfp4-probe inspect … | head`) ends the process quietly, as for any Unix
    // tool, instead of a failed print that Rust's ignored SIGPIPE would turn into a panic.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    // A write past `ulimit -f` fails (EFBIG: exit 2 naming the output) instead of SIGXFSZ
    // killing the process; a shard truncated while mapped (SIGBUS) says so and exits 2.
    nvfp4_probe::output::fatal::install();
    nvfp4_probe::profile::mark("start");
    let cli = Cli::parse();
    let code = match std::panic::catch_unwind(|| nvfp4_probe::commands::dispatch(cli)) {
        Ok(Ok(code)) => code,
        Ok(Err(e)) => {
            eprintln!("error: {e}");
            e.exit_code()
        }
        Err(_) => {
            eprintln!("error: internal failure (panic); this is a bug in nvfp4-probe");
            nvfp4_probe::error::EXIT_UNUSABLE
        }
    };
    if nvfp4_probe::profile::enabled() {
        eprintln!(
            "profile host spans, whole process (s, count): {}",
            nvfp4_probe::profile::spans()
        );
    }
    nvfp4_probe::profile::mark("exit");
    std::process::exit(code);
}
