//! The two modes stay apart, and the core names neither.
//!
//! The rule: `src/` holds two modes, `cluster/` (Kubernetes) and `standalone/` (one host), and
//! the binary, `main.rs`, which picks a mode from the command line. Every other entry of `src/`
//! is a room of the shared core (`app`, `controller`, `ui`, `discovery`, `lease`, `health`,
//! `telemetry`, ..., and the crate root `lib.rs`): the core names neither mode, and a room added
//! later is covered without touching this test. A mode may name the core, never the other mode.
//! What a mode adds to a core feature (its part of the status page, its backend) lives in the
//! mode's folder and implements a trait the core owns.
//!
//! Read as text: a path named in a `use` or an expression counts; comments do not.

use std::path::{Path, PathBuf};

fn rust_files(path: &Path) -> Vec<PathBuf> {
    if path.is_file() {
        return vec![path.to_owned()];
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(path).expect("a source folder") {
        let path = entry.expect("an entry").path();
        if path.is_dir() {
            files.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files
}

/// Every line of code (not a comment) in `roots` below `src` that names one of `forbidden`.
fn offenders_in(src: &Path, roots: &[&str], forbidden: &[&str]) -> Vec<String> {
    let mut found = Vec::new();
    for root in roots {
        for file in rust_files(&src.join(root)) {
            let text = std::fs::read_to_string(&file).expect("readable source");
            for (n, line) in text.lines().enumerate() {
                let code = line.split("//").next().unwrap_or_default();
                if forbidden.iter().any(|f| code.contains(f)) {
                    let name = file.strip_prefix(src).unwrap_or(&file).display();
                    found.push(format!("src/{name}:{}: {}", n + 1, line.trim()));
                }
            }
        }
    }
    found
}

fn offenders(roots: &[&str], forbidden: &[&str]) -> Vec<String> {
    offenders_in(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        roots,
        forbidden,
    )
}

#[test]
fn standalone_mode_names_nothing_of_cluster_mode() {
    let found = offenders(
        &["standalone"],
        &["crate::cluster", "cluster::", "KubeBackend", "kube::Client"],
    );
    assert!(
        found.is_empty(),
        "standalone code uses cluster mode:\n{}",
        found.join("\n")
    );
}

#[test]
fn cluster_mode_names_nothing_of_standalone_mode() {
    let found = offenders(&["cluster"], &["standalone", "StateOwners", "FileCheckpoint"]);
    assert!(
        found.is_empty(),
        "cluster code uses standalone mode:\n{}",
        found.join("\n")
    );
}

/// The modes' folders and the binary, which names both; everything else in `src/` is core.
const NOT_CORE: [&str; 3] = ["cluster", "standalone", "main.rs"];

/// Every entry of `src/` that is a room of the shared core.
fn core_rooms() -> Vec<String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut rooms: Vec<String> = std::fs::read_dir(&src)
        .expect("the source folder")
        .map(|entry| {
            entry
                .expect("an entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|name| !NOT_CORE.contains(&name.as_str()))
        .collect();
    rooms.sort();
    rooms
}

#[test]
fn every_room_but_the_modes_and_the_binary_is_core() {
    let rooms = core_rooms();
    for room in [
        "app",
        "controller",
        "ui",
        "discovery",
        "lease",
        "health",
        "telemetry",
        "gateway",
        "lib.rs",
    ] {
        assert!(
            rooms.iter().any(|r| r == room),
            "{room} should be a core room: {rooms:?}"
        );
    }
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    for outside in NOT_CORE {
        assert!(
            src.join(outside).exists(),
            "src/{outside} is named as no core room but is gone"
        );
    }
}

#[test]
fn the_core_names_neither_mode() {
    let rooms = core_rooms();
    let roots: Vec<&str> = rooms.iter().map(String::as_str).collect();
    let found = offenders(
        &roots,
        &["crate::cluster", "crate::standalone", "cluster::", "standalone::"],
    );
    assert!(
        found.is_empty(),
        "the shared core uses a mode:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_old_mode_folders_are_gone() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    for old in ["controller/cluster", "app/cluster.rs", "ui/cluster.rs", "store"] {
        assert!(
            !src.join(old).exists(),
            "src/{old} should have moved into a mode's folder"
        );
    }
}

#[test]
fn the_lint_finds_a_use_in_code_and_ignores_comments() {
    let src = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(src.path().join("standalone/deep")).unwrap();
    std::fs::write(
        src.path().join("standalone/deep/x.rs"),
        "// mirrors controller::cluster::backoff\nuse crate::controller::cluster::backoff; // here\n",
    )
    .unwrap();
    let found = offenders_in(src.path(), &["standalone"], &["controller::cluster"]);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("src/standalone/deep/x.rs:2:"), "{found:?}");
}
