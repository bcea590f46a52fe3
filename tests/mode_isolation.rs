//! The two modes stay apart: standalone mode's code (`src/standalone/`, its embedded store
//! included) names nothing of cluster mode's (`src/cluster/`), and cluster mode's code nothing
//! of standalone mode's. What both need lives in the shared core (`app`, `controller`,
//! `machine`, `lease`, ...), which names neither mode. Read as text: a path named in a `use` or
//! an expression counts; comments do not.

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

#[test]
fn the_core_names_neither_mode() {
    let found = offenders(
        &["app", "controller"],
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
    for old in ["controller/cluster", "app/cluster.rs", "store"] {
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
