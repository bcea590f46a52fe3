//! Build script: generates the typed lifecycle machines from `machines/*.yaml`.
//!
//! Each table is parsed and validated by [`table`] (the build fails with a message naming the
//! offending row), then [`generate`] turns it into `$OUT_DIR/<machine>_machine.rs`, which
//! `src/machine/table.rs` includes. Nothing checked in is written; the output is formatted Rust,
//! readable at `target/debug/build/egress-proxies-operator-*/out/proxy_machine.rs`.

#[path = "build/generate.rs"]
mod generate;
#[path = "build/table.rs"]
mod table;

use std::path::{Path, PathBuf};
use std::{env, fs};

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=build");
    println!("cargo::rerun-if-changed=machines");

    let manifest_dir =
        PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let machines_dir = manifest_dir.join("machines");

    let mut tables: Vec<PathBuf> = fs::read_dir(&machines_dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", machines_dir.display()))
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|ext| ext == "yaml"))
        .collect();
    tables.sort();
    if tables.is_empty() {
        panic!("no transition table found in {}", machines_dir.display());
    }

    for path in tables {
        let rel = format!(
            "machines/{}",
            path.file_name().and_then(|n| n.to_str()).unwrap_or("?")
        );
        let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("{rel}: cannot read: {e}"));
        let table = table::load_table(&text).unwrap_or_else(|errors| {
            panic!(
                "\n{rel}: the transition table is invalid ({} problem(s)):\n  - {}\n",
                errors.len(),
                errors.join("\n  - ")
            )
        });
        let code = generate::generate(&table, &rel);
        write_if_changed(&out_dir.join(format!("{}_machine.rs", table.machine)), &code);
    }
}

/// Leaves the file (and its mtime) alone when nothing changed.
fn write_if_changed(path: &Path, contents: &str) {
    if fs::read_to_string(path).is_ok_and(|old| old == contents) {
        return;
    }
    fs::write(path, contents).unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
}
