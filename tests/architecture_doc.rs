//! docs/architecture.md's module table cannot drift from `src/`: every module the crate
//! declares has a row, every second-level module is named in its parent's row, and every
//! `module::path` the table names exists (a module, or an item defined in one).

use std::{
    collections::BTreeSet,
    fs,
    path::{Path, PathBuf},
};

const DOC: &str = "docs/architecture.md";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The modules `file` declares (`mod x;`, `pub mod x;`, `pub(crate) mod x;`), leaving out
/// those only compiled for tests.
fn declared_modules(file: &Path) -> Vec<String> {
    let text = fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let mut modules = Vec::new();
    let mut test_only = false;
    for line in text.lines().map(str::trim) {
        if line.starts_with("#[cfg(test)]") {
            test_only = true;
            continue;
        }
        let declaration = line
            .strip_prefix("pub(crate) mod ")
            .or_else(|| line.strip_prefix("pub mod "))
            .or_else(|| line.strip_prefix("mod "))
            .and_then(|rest| rest.strip_suffix(';'));
        if let Some(name) = declaration
            && !test_only
        {
            modules.push(name.to_owned());
        }
        if !line.starts_with("#[") {
            test_only = false;
        }
    }
    modules
}

/// The source file of module `path` (`["lease", "store"]`), if it is one.
fn module_file(path: &[&str]) -> Option<PathBuf> {
    let mut dir = root().join("src");
    let mut file = dir.join("lib.rs");
    for segment in path {
        if !declared_modules(&file).iter().any(|m| m == segment) {
            return None;
        }
        let flat = dir.join(format!("{segment}.rs"));
        let nested = dir.join(segment).join("mod.rs");
        dir = dir.join(segment);
        file = if nested.exists() { nested } else { flat };
    }
    Some(file)
}

/// Whether `name` is defined or re-exported in module file `file` or the files beside it.
fn defines(file: &Path, name: &str) -> bool {
    let folder = if file.ends_with("mod.rs") || file.ends_with("lib.rs") {
        file.parent().map(Path::to_path_buf)
    } else {
        None
    };
    let mut files = vec![file.to_path_buf()];
    if let Some(folder) = folder {
        files.extend(
            walk(&folder)
                .into_iter()
                .filter(|f| f.extension().is_some_and(|e| e == "rs")),
        );
    }
    let patterns = ["struct", "enum", "trait", "type", "fn", "const", "static", "mod"]
        .map(|kind| format!("{kind} {name}"));
    files.iter().any(|f| {
        let text = fs::read_to_string(f).unwrap_or_default();
        patterns.iter().any(|p| {
            text.match_indices(p.as_str())
                .any(|(at, _)| !text[at + p.len()..].starts_with(|c: char| c.is_alphanumeric() || c == '_'))
        }) || text.contains(&format!("as {name};"))
    })
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            found.extend(walk(&path));
        } else {
            found.push(path);
        }
    }
    found
}

/// The rows of the table under `## Modules`: (the module cell, the rest of the row).
fn rows() -> Vec<(String, String)> {
    let text = fs::read_to_string(root().join(DOC)).unwrap();
    let section = text
        .split("\n## Modules\n")
        .nth(1)
        .expect("docs/architecture.md has a `## Modules` section");
    section
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2)
        .map(|line| {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            (cells[1].to_owned(), cells[2..].join(" | "))
        })
        .collect()
}

/// The backticked words of `text`.
fn code_spans(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

/// The module a row is about (`provider::libvirt` for "`provider::libvirt` (types ...)").
fn row_module(cell: &str) -> Option<&str> {
    code_spans(cell).into_iter().next().filter(|m| *m != "main.rs")
}

#[test]
fn every_module_has_a_row_and_every_row_names_a_module() {
    let rows = rows();
    let documented: BTreeSet<&str> = rows.iter().filter_map(|(cell, _)| row_module(cell)).collect();
    let declared = declared_modules(&root().join("src/lib.rs"));
    let missing: Vec<&String> = declared
        .iter()
        .filter(|m| !documented.contains(m.as_str()))
        .collect();
    assert!(missing.is_empty(), "modules without a row in {DOC}: {missing:?}");
    for module in documented {
        let path: Vec<&str> = module.split("::").collect();
        assert!(
            module_file(&path).is_some(),
            "{DOC} has a row for `{module}`, which src/ does not declare"
        );
    }
}

#[test]
fn every_second_level_module_is_named_in_its_parents_rows() {
    let rows = rows();
    let mut unnamed = Vec::new();
    for top in declared_modules(&root().join("src/lib.rs")) {
        let Some(file) = module_file(&[top.as_str()]) else {
            continue;
        };
        let text: String = rows
            .iter()
            .filter(|(cell, _)| {
                row_module(cell).is_some_and(|m| m == top || m.starts_with(&format!("{top}::")))
            })
            .map(|(cell, rest)| format!("{cell} {rest}"))
            .collect();
        let named: BTreeSet<&str> = code_spans(&text)
            .into_iter()
            .flat_map(|span| span.split("::").chain(span.split(['(', ' ', ',', '.'])))
            .collect();
        for child in declared_modules(&file) {
            if !named.contains(child.as_str()) {
                unnamed.push(format!("{top}::{child}"));
            }
        }
    }
    assert!(
        unnamed.is_empty(),
        "modules {DOC} does not name in their parent's row (write `child` in backticks there): {unnamed:?}"
    );
}

#[test]
fn every_module_path_the_table_names_exists() {
    let declared = declared_modules(&root().join("src/lib.rs"));
    let mut dangling = Vec::new();
    for (cell, rest) in rows() {
        for span in code_spans(&format!("{cell} {rest}")) {
            let path: Vec<&str> = span.split("::").collect();
            if path.len() < 2 || !declared.iter().any(|m| m == path[0]) {
                continue;
            }
            // The longest prefix that is a module; what follows must be one item defined there.
            let resolved = (1..=path.len())
                .rev()
                .find_map(|n| module_file(&path[..n]).map(|file| (n, file)));
            let ok = match resolved {
                Some((n, _)) if n == path.len() => true,
                Some((n, file)) if n + 1 == path.len() => defines(&file, path[n]),
                _ => false,
            };
            if !ok {
                dangling.push(span.to_owned());
            }
        }
    }
    assert!(
        dangling.is_empty(),
        "{DOC} names paths that are not in src/: {dangling:?}"
    );
}
