//! The `[[list]]` section: named sets of prefixes a rule matches with
//! `src = "@name"` or `dst = "@name"`, written inline (`entries = [...]`) or read from a file
//! of one address or prefix per line (what a fail2ban or CrowdSec action
//! writes). A bad line is an error at that file's line, and the profile is
//! rejected whole. docs/lists.md is the reference.

use super::{
    error::{line_col_of, Ctx, ProfileError},
    memory::human_bytes,
    model::{List, Rule, RuleSet},
    primitives::{name, parse_cidr},
    raw::RawList,
};
use flowctl_common::{
    tables::{compile, Cidr, CompileError, PrefixList, Source},
    MAX_LIST_PREFIXES,
};
use std::{
    path::{Path, PathBuf},
    sync::Arc,
};
use toml::Spanned;

/// Whether a list's file is read.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Files<'a> {
    Read,
    /// Names only: a file list has no prefixes. For readers of an applied
    /// profile's copy (`status`, `top`, `explain`, the metrics), which ask
    /// the kernel's tables, not the lists; the copy sits in the run-time
    /// directory, where relative file names would not resolve anyway.
    Unread,
    /// Names only, for a profile every host of a fleet reads its own list
    /// files for (`flowctl publish`): the paths must be absolute.
    Elsewhere,
    /// Every file but this list's, which a list update replaces from
    /// another file (its own may be the one that is broken).
    ReadExcept(&'a str),
}

/// Validates the profile's lists, reading their files.
pub fn lists(
    cx: &Ctx,
    raw: &[Spanned<RawList>],
    files: Files<'_>,
) -> Result<Vec<List>, ProfileError> {
    let mut out: Vec<List> = Vec::new();
    let mut total = 0usize;
    for r in raw {
        let mode = match files {
            Files::ReadExcept(n) if r.get_ref().name.get_ref().trim() == n => Files::Unread,
            Files::ReadExcept(_) => Files::Read,
            f => f,
        };
        let l = list(cx, r, mode)?;
        if out.iter().any(|o| o.prefixes.name == l.prefixes.name) {
            return Err(cx.err(r.span(), format!("duplicate list name `{}`", l.prefixes.name)));
        }
        total += l.prefixes.prefixes.len();
        if total > MAX_LIST_PREFIXES {
            return Err(cx.err(
                r.span(),
                format!("the lists hold {total} prefixes together, more than {MAX_LIST_PREFIXES}: split the work across hosts or aggregate the prefixes"),
            ));
        }
        out.push(l);
    }
    Ok(out)
}

fn list(cx: &Ctx, raw: &Spanned<RawList>, files: Files<'_>) -> Result<List, ProfileError> {
    let r = raw.get_ref();
    let name = name(
        cx,
        &r.name,
        64,
        "list names are 1-64 characters of letters, digits, '-', '_' or '.'",
    )?;
    let line = cx.line(&raw.span());
    let (prefixes, file) = match (&r.file, &r.entries) {
        (Some(_), Some(e)) => {
            return Err(cx.err(e.span(), "a list has `file` or `entries`, not both"));
        }
        (None, None) => {
            return Err(cx.err(
                raw.span(),
                format!("list `{name}` needs `file = \"/etc/flowctl/{name}.txt\"` or `entries = [\"192.0.2.0/24\", ...]`"),
            ));
        }
        (None, Some(entries)) => {
            let mut v = Vec::with_capacity(entries.get_ref().len());
            for e in entries.get_ref() {
                v.push(parse_cidr(e.get_ref().trim()).map_err(|m| cx.err(e.span(), m))?);
            }
            (v, None)
        }
        (Some(f), None) if files == Files::Unread => (Vec::new(), Some(f.get_ref().into())),
        (Some(f), None) if files == Files::Elsewhere => {
            if !Path::new(f.get_ref()).is_absolute() {
                return Err(cx.err(
                    f.span(),
                    "a list file of a profile published to etcd must be an absolute path (each host reads its own copy)",
                ));
            }
            (Vec::new(), Some(f.get_ref().into()))
        }
        (Some(f), None) => {
            let path = resolve(cx, f)?;
            let v = read_file(&path, &format!("list `{name}` of {}:{line}", cx.file))?;
            (v, Some(path))
        }
    };
    let from = if files == Files::Read { file.clone() } else { None };
    Ok(List { prefixes: PrefixList { name, prefixes: prefixes.into() }, file, from, line })
}

/// `set` with list `name`'s prefixes read again: from `file`, else from
/// the file the profile names. Every rule naming the list sees the new
/// prefixes; everything else is `set` as it was, and the result passes the
/// checks a profile does (the lists' total, the kernel's classes, the
/// memory budget). `flowctl list update` applies it.
pub fn replace(set: &RuleSet, name: &str, file: Option<&Path>) -> Result<RuleSet, ListError> {
    let Some(i) = set.lists.iter().position(|l| l.prefixes.name == name) else {
        let names: Vec<&str> = set.lists.iter().map(|l| l.prefixes.name.as_str()).collect();
        return Err(ListError::Unknown(name.to_string(), names.join(", ")));
    };
    let path = match (file, &set.lists[i].file) {
        (Some(f), _) => f.to_path_buf(),
        (None, Some(f)) => f.clone(),
        (None, None) => return Err(ListError::Inline(name.to_string())),
    };
    let prefixes: Arc<[Cidr]> = read_file(&path, &format!("list `{name}`"))?.into();
    let new = PrefixList { name: name.to_string(), prefixes };
    let mut next = set.clone();
    next.lists[i].prefixes = new.clone();
    next.lists[i].from = Some(path);
    for r in &mut next.rules {
        for side in [&mut r.spec.src, &mut r.spec.dst] {
            if matches!(side, Some(Source::List(l)) if l.name == name) {
                *side = Some(Source::List(new.clone()));
            }
        }
    }
    let total = trie_share(&next.lists, &next.rules);
    if total > MAX_LIST_PREFIXES as u64 {
        return Err(ListError::TooMany(total));
    }
    next.settings.list_prefixes = total;
    let specs: Vec<_> = next.rules.iter().map(|r| r.spec.clone()).collect();
    compile(&specs, 0)?;
    let need = next.settings.kernel_memory_bytes();
    if need > next.settings.memory_budget {
        return Err(ListError::OverBudget(
            human_bytes(need),
            human_bytes(next.settings.memory_budget),
        ));
    }
    Ok(next)
}

/// The trie entries per slot that the profile's lists and destinations
/// take beyond the rules' own source prefixes and the sources' two
/// default routes (`SRC_TRIE_ENTRIES` keeps `MAX_LIST_PREFIXES` per slot
/// for them): each list's prefixes once per side (`src`, `dst`) rules
/// name it on, and once when none does (it is held to be updated); with
/// any destination, the rules' own destination prefixes and that side's
/// two default routes.
pub fn trie_share(lists: &[List], rules: &[Rule]) -> u64 {
    let names = |side: fn(&Rule) -> &Option<Source>, name: &str| {
        rules.iter().any(|r| matches!(side(r), Some(Source::List(l)) if l.name == name)) as u64
    };
    let listed: u64 = lists
        .iter()
        .map(|l| {
            let n = &l.prefixes.name;
            let sides = names(|r| &r.spec.src, n) + names(|r| &r.spec.dst, n);
            l.prefixes.prefixes.len() as u64 * sides.max(1)
        })
        .sum();
    let destinations = if rules.iter().any(|r| r.spec.dst.is_some()) {
        2 + rules.iter().filter(|r| matches!(r.spec.dst, Some(Source::Prefix(_)))).count() as u64
    } else {
        0
    };
    listed + destinations
}

/// Why a list update was refused (nothing was applied).
#[derive(Debug, thiserror::Error)]
pub enum ListError {
    #[error("the profile has no list `{0}` (its lists: {1})")]
    Unknown(String, String),
    #[error("list `{0}` is inline in the profile (`entries`): name a FILE, or change the profile and apply it")]
    Inline(String),
    #[error("{0}")]
    Bad(#[from] ProfileError),
    #[error("the lists would hold {0} prefixes together (a list named as both `src` and `dst` counts twice), more than {MAX_LIST_PREFIXES}")]
    TooMany(u64),
    #[error(transparent)]
    Classes(#[from] CompileError),
    #[error("the tables would need {0} of kernel memory, over the profile's memory_budget of {1}")]
    OverBudget(String, String),
}

/// A list file's path: as written when absolute, else from the profile's
/// directory (a profile from etcd has none, so there it must be absolute).
fn resolve(cx: &Ctx, f: &Spanned<String>) -> Result<PathBuf, ProfileError> {
    let p = Path::new(f.get_ref());
    if p.is_absolute() {
        return Ok(p.to_path_buf());
    }
    if cx.file.contains("://") {
        return Err(cx.err(
            f.span(),
            "a list file of a profile from etcd must be an absolute path (each host reads its own copy)",
        ));
    }
    let joined = Path::new(cx.file).parent().unwrap_or(Path::new("")).join(p);
    // Absolute, so the CLI, `check` and the agent (which is handed the
    // profile's canonical path) read the same file, and `status` names it.
    Ok(std::fs::canonicalize(&joined).unwrap_or(joined))
}

/// Reads a list file: one address or prefix per line, `#` starts a
/// comment, blank lines are skipped. `whose` says in errors whose file it
/// is. The first bad line is the error, at its line and column.
pub fn read_file(path: &Path, whose: &str) -> Result<Vec<Cidr>, ProfileError> {
    let file = path.display().to_string();
    let unreadable = |msg: String| ProfileError { file: file.clone(), line: 0, col: 0, msg };
    // A regular file of a bounded size: a FIFO would block the agent, and
    // a file of far more lines than a list may hold would cost it memory
    // before the count is checked (a prefix takes at least 8 bytes a line).
    let meta =
        std::fs::metadata(path).map_err(|e| unreadable(format!("cannot read {whose}: {e}")))?;
    if !meta.is_file() {
        return Err(unreadable(format!("{whose}: not a regular file")));
    }
    if meta.len() > 64 * MAX_LIST_PREFIXES as u64 {
        return Err(unreadable(format!(
            "{whose}: {} bytes, more than a list of {MAX_LIST_PREFIXES} prefixes can take",
            meta.len()
        )));
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| unreadable(format!("cannot read {whose}: {e}")))?;
    parse_text(&file, &text).map_err(|mut e| {
        e.msg = format!("{} ({whose})", e.msg);
        e
    })
}

/// The prefixes of a list file's text; `file` names it in errors.
pub fn parse_text(file: &str, text: &str) -> Result<Vec<Cidr>, ProfileError> {
    let mut out = Vec::new();
    // A byte-order mark some editors write is not part of line 1.
    let mut offset = if text.starts_with('\u{feff}') { '\u{feff}'.len_utf8() } else { 0 };
    for raw_line in text[offset..].split_inclusive('\n') {
        let start = offset;
        offset += raw_line.len();
        let content = raw_line.split('#').next().unwrap_or("");
        let token = content.trim();
        if token.is_empty() {
            continue;
        }
        let at = start + (content.len() - content.trim_start().len());
        let err = |msg: String| {
            let (line, col) = line_col_of(text, at);
            ProfileError { file: file.to_string(), line, col, msg }
        };
        if token.contains(char::is_whitespace) {
            return Err(err(format!(
                "`{token}`: one address or prefix per line (a comment starts with #)"
            )));
        }
        out.push(parse_cidr(token).map_err(err)?);
        if out.len() > MAX_LIST_PREFIXES {
            return Err(err(format!("more than {MAX_LIST_PREFIXES} prefixes in one list")));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::parse;

    #[test]
    fn a_file_of_addresses_prefixes_and_comments() {
        let text = "# banned by fail2ban\n192.0.2.7\n\n  198.51.100.0/24  # a whole net\n2001:db8::/32\r\n2001:db8:1::9\n";
        let v = parse_text("b.txt", text).unwrap();
        let shown: Vec<String> = v.iter().map(|c| c.to_string()).collect();
        assert_eq!(
            shown,
            ["192.0.2.7/32", "198.51.100.0/24", "2001:db8::/32", "2001:db8:1::9/128"]
        );
        // A byte-order mark before line 1.
        assert_eq!(parse_text("b.txt", "\u{feff}192.0.2.7\n").unwrap().len(), 1);
    }

    #[test]
    fn a_bad_line_is_named_by_file_line_and_column() {
        for (text, line, col, needle) in [
            ("192.0.2.7\n  192.0.2.300\n", 2, 3, "not an IP"),
            ("192.0.2.7\n\n10.0.0.1/8 # oops\n", 3, 1, "host bits set"),
            ("192.0.2.7 198.51.100.1\n", 1, 1, "one address or prefix per line"),
            ("# ok\n10.0.0.0/33\n", 2, 1, "longer than /32"),
            ("10.0.0.0/+8\n", 1, 1, "bad prefix length"),
            ("::ffff:192.0.2.7\n", 1, 1, "write 192.0.2.7"),
        ] {
            let e = parse_text("b.txt", text).unwrap_err();
            assert_eq!((e.line, e.col), (line, col), "{text:?}: {e}");
            assert!(e.to_string().starts_with(&format!("b.txt:{line}:{col}:")), "{e}");
            assert!(e.msg.contains(needle), "{text:?}: {e}");
        }
    }

    #[test]
    fn lists_in_the_profile() {
        let dir = std::env::temp_dir().join(format!("flowctl-lists-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("block.txt"), "192.0.2.0/24\n2001:db8::/48\n").unwrap();
        let profile = dir.join("p.toml");
        let text = r#"
[[list]]
name = "block"
file = "block.txt"

[[list]]
name = "partners"
entries = ["198.51.100.0/24"]

[[rule]]
name = "banned"
src = "@block"
action = "block"

[[rule]]
name = "partners"
src = "@partners"
rate = "100/s"
"#;
        let s = parse(&profile.display().to_string(), text).unwrap();
        assert_eq!(s.lists.len(), 2);
        assert_eq!(s.lists[0].file.as_deref(), Some(dir.join("block.txt").as_path()));
        assert_eq!(s.lists[0].prefixes.prefixes.len(), 2);
        assert_eq!(s.rules[0].match_text(), "any from @block to port any");
        assert_eq!(s.settings.list_prefixes, 3);
        assert!(s.rules[0].block && s.rules[0].interval_fp == u64::MAX && s.rules[0].burst_ns == 0);
        assert_eq!(s.rules[0].action, flowctl_common::action::DROP);

        // The list file's bad line: its file and line, and nothing else.
        std::fs::write(dir.join("block.txt"), "192.0.2.0/24\nnonsense\n").unwrap();
        let e = parse(&profile.display().to_string(), text).unwrap_err();
        assert_eq!(e.file, dir.join("block.txt").display().to_string());
        assert_eq!((e.line, e.col), (2, 1));
        assert!(e.msg.contains("list `block` of"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn list_errors_in_the_profile() {
        let rule = "[[rule]]\nname = \"r\"\nsrc = \"@block\"\naction = \"block\"\n";
        for (text, line, needle) in [
            (rule.to_string(), 3, "no [[list]] named `block`"),
            (format!("[[list]]\nname = \"block\"\n{rule}"), 1, "needs `file"),
            (
                format!("[[list]]\nname = \"block\"\nfile = \"x\"\nentries = []\n{rule}"),
                4,
                "not both",
            ),
            (
                format!("[[list]]\nname = \"block\"\nentries = [\"10.0.0.0/33\"]\n{rule}"),
                3,
                "longer than /32",
            ),
            (
                format!("[[list]]\nname = \"b\"\nentries = []\n[[list]]\nname = \"b\"\nentries = []\n{rule}"),
                4,
                "duplicate list name",
            ),
            (
                format!("[[list]]\nname = \"block\"\nfile = \"/nonexistent/flowctl-block.txt\"\n{rule}"),
                0,
                "cannot read list `block`",
            ),
        ] {
            let e = crate::profile::tests::err(&text);
            assert_eq!(e.line, line, "{text}: {e}");
            assert!(e.to_string().contains(needle), "{text}: {e}");
        }
    }

    #[test]
    fn destinations_by_prefix_and_by_list() {
        let text = r#"
[[list]]
name = "block"
entries = ["192.0.2.0/24", "2001:db8::/48"]

[[list]]
name = "partners"
entries = ["198.51.100.0/24"]

[[rule]]
name = "from-banned"
src = "@block"
action = "block"

[[rule]]
name = "to-banned"
proto = "tcp"
dst = "@block"
dport = 443
action = "block"

[[rule]]
name = "partners-to-api"
src = "@partners"
dst = "203.0.113.0/24"
rate = "100/s"
"#;
        let s = parse("p.toml", text).unwrap();
        assert_eq!(s.rules[1].match_text(), "tcp from any to @block port 443");
        assert_eq!(s.rules[2].match_text(), "any from @partners to 203.0.113.0/24 port any");
        // `block` is named on both sides (2 x 2), `partners` on one (1), and
        // with destinations their two default routes and the one dst prefix.
        assert_eq!(s.settings.list_prefixes, 4 + 1 + 2 + 1);
        let t = compile(&s.rules.iter().map(|r| r.spec.clone()).collect::<Vec<_>>(), 0).unwrap();
        let a = |x: &str| x.parse::<std::net::IpAddr>().unwrap();
        let at = |src, dst, port| t.classify(&a(src), &a(dst), 6, Some(port));
        assert_eq!(at("192.0.2.9", "10.0.0.1", 80), Some(0));
        assert_eq!(at("10.0.0.1", "192.0.2.9", 443), Some(1));
        assert_eq!(at("10.0.0.1", "192.0.2.9", 80), None);
        assert_eq!(at("198.51.100.4", "203.0.113.9", 80), Some(2));
        assert_eq!(at("198.51.100.4", "203.0.114.9", 80), None);

        // A destination of the other IP version than the source never
        // matches: refused at the `dst` line.
        let e = crate::profile::tests::err(
            "[[rule]]\nname = \"r\"\nsrc = \"10.0.0.0/8\"\ndst = \"2001:db8::/32\"\n",
        );
        assert_eq!(e.line, 4, "{e}");
        assert!(e.msg.contains("different IP versions"), "{e}");
        let e = crate::profile::tests::err("[[rule]]\nname = \"r\"\ndst = \"@nope\"\n");
        assert_eq!(e.line, 3, "{e}");
        assert!(e.msg.contains("no [[list]] named `nope`"), "{e}");
    }

    #[test]
    fn an_etcd_profile_names_list_files_absolutely() {
        let text =
            "[[list]]\nname = \"b\"\nfile = \"b.txt\"\n[[rule]]\nname = \"r\"\nsrc = \"@b\"\n";
        let e = parse("etcd://10.0.0.5:2379/flowctl/web", text).unwrap_err();
        assert!(e.msg.contains("absolute path"), "{e}");
    }
}
