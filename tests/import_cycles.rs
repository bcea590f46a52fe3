//! No import circle inside a folder of `src/`, `src/` itself included: within each folder, the
//! modules (its files and subfolders, `mod.rs` aside) import each other along one direction
//! only, so each can be read after the ones it uses. Read from the text: every `super::` path of
//! a module's files (and `crate::<folder>::` path) that names a sibling module is an edge; test
//! modules (a `#[cfg(test)] mod … {` to the end of its file, and `tests.rs` files) are left out.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
};

/// The sibling modules of `dir`: `x.rs` files and folders with a `mod.rs`, tests aside.
fn siblings(dir: &Path) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for entry in fs::read_dir(dir).expect("a src folder").flatten() {
        let path = entry.path();
        let name = path
            .file_stem()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_owned();
        let module_folder = path.is_dir() && path.join("mod.rs").exists() && name != "tests";
        let module_file = path.extension().is_some_and(|e| e == "rs")
            && !["mod", "lib", "main", "tests"].contains(&name.as_str());
        if module_folder || module_file {
            names.insert(name);
        }
    }
    names
}

/// Every `.rs` file below `path` (itself, when it is a file), `tests.rs` files aside.
fn files_of(path: &Path) -> Vec<PathBuf> {
    if path.is_file() {
        return vec![path.to_owned()];
    }
    let mut files = Vec::new();
    for entry in fs::read_dir(path).expect("a module folder").flatten() {
        let p = entry.path();
        if p.is_dir() {
            files.extend(files_of(&p));
        } else if p.extension().is_some_and(|e| e == "rs") && p.file_name().is_some_and(|n| n != "tests.rs") {
            files.push(p);
        }
    }
    files
}

/// The text of `file` without comments and without its inline test module.
fn code_of(file: &Path) -> String {
    let text = fs::read_to_string(file).expect("a source file");
    let mut code = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let trimmed = line.trim();
        if trimmed == "#[cfg(test)]"
            && lines
                .peek()
                .is_some_and(|next| next.trim_start().starts_with("mod ") && next.trim_end().ends_with('{'))
        {
            break;
        }
        if trimmed.starts_with("//") {
            continue;
        }
        code.push_str(line);
        code.push('\n');
    }
    code
}

/// The first identifiers of the paths that follow each `prefix` in `code`: `prefix a::b` gives
/// `a`, `prefix {a, b::c, d as e}` gives `a`, `b` and `d`.
fn named_after(code: &str, prefix: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let ident = |s: &str| -> String {
        s.trim_start()
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    for (at, _) in code.match_indices(prefix) {
        let rest = &code[at + prefix.len()..];
        // `super::super::x` is not a sibling of this folder's module.
        if code[..at].ends_with("super::") || rest.starts_with("super::") {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 0;
            let mut item = String::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        names.insert(ident(&item));
                        item.clear();
                        continue;
                    }
                    _ => {}
                }
                item.push(c);
            }
            names.insert(ident(&item));
        } else {
            names.insert(ident(rest));
        }
    }
    names.remove("");
    names
}

/// The module path of `dir` below `src/` (`["discovery", "auth"]`).
fn module_path(src: &Path, dir: &Path) -> Vec<String> {
    dir.strip_prefix(src)
        .expect("below src")
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect()
}

/// A circle among `edges`, if there is one (depth-first search).
fn circle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut found = path[at..].to_vec();
            found.push(node.to_owned());
            return Some(found);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in edges.get(node).into_iter().flatten() {
            if let Some(found) = visit(next, edges, path, done) {
                return Some(found);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    edges
        .keys()
        .find_map(|node| visit(node, edges, &mut Vec::new(), &mut done))
}

/// The sibling edges of folder `dir`: module -> the sibling modules its files import.
fn edges_of(src: &Path, dir: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let names = siblings(dir);
    let crate_prefix = match module_path(src, dir).as_slice() {
        [] => "crate::".to_owned(),
        parts => format!("crate::{}::", parts.join("::")),
    };
    let mut edges = BTreeMap::new();
    for name in &names {
        let flat = dir.join(format!("{name}.rs"));
        let module = if flat.exists() { flat } else { dir.join(name) };
        let mut uses = BTreeSet::new();
        for file in files_of(&module) {
            let code = code_of(&file);
            // `super::` in `x.rs` or `x/mod.rs` is this folder; deeper files' `super::` is not.
            let direct = file == module || file == module.join("mod.rs");
            if direct && dir != src {
                uses.extend(named_after(&code, "super::"));
            }
            uses.extend(named_after(&code, &crate_prefix));
        }
        uses.retain(|used| used != name && names.contains(used));
        edges.insert(name.clone(), uses);
    }
    edges
}

fn folders(dir: &Path) -> Vec<PathBuf> {
    let mut all = vec![dir.to_owned()];
    for entry in fs::read_dir(dir).expect("a src folder").flatten() {
        let path = entry.path();
        if path.is_dir() && path.file_name().is_some_and(|n| n != "tests") {
            all.extend(folders(&path));
        }
    }
    all
}

#[test]
fn no_folder_of_src_has_an_import_circle() {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut circles = Vec::new();
    for dir in folders(&src) {
        if let Some(found) = circle(&edges_of(&src, &dir)) {
            circles.push(format!("{}: {}", dir.display(), found.join(" -> ")));
        }
    }
    assert!(circles.is_empty(), "import circles:\n{}", circles.join("\n"));
}

#[test]
fn the_reader_sees_the_edges_that_make_a_circle() {
    // The parser against the shapes the source uses, so the test above cannot pass by reading
    // nothing.
    let code = "use super::{\n    a::X, b, c::{D, E},\n    f as g,\n};\nuse super::h::I;\nlet x = super::super::j::K;\n";
    let named: Vec<_> = named_after(code, "super::").into_iter().collect();
    assert_eq!(named, ["a", "b", "c", "f", "h"]);
    let edges = BTreeMap::from([
        ("a".to_owned(), BTreeSet::from(["b".to_owned()])),
        ("b".to_owned(), BTreeSet::from(["c".to_owned()])),
        ("c".to_owned(), BTreeSet::from(["a".to_owned()])),
    ]);
    assert_eq!(
        circle(&edges),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src");
    let discovery = edges_of(&src, &src.join("discovery"));
    assert!(discovery["leases"].contains("handlers"), "{discovery:?}");
    assert!(discovery["request"].contains("fast_body"), "{discovery:?}");
    // src/ itself: its rooms' edges are their `crate::` paths.
    let rooms = edges_of(&src, &src);
    assert!(rooms["ui"].contains("markup"), "{rooms:?}");
}
