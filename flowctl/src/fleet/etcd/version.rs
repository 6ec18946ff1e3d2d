//! Which profile in etcd is the newest complete one, and whether the agent
//! should act on it: the revision and generation logic, pure (the watcher
//! feeds it keys and events; the agent asks it).
//!
//! A publish writes `profile` and bumps `generation` in one transaction,
//! so both keys change at one revision and etcd delivers them in one watch
//! response (without `fragment`, a revision's events are never split;
//! etcd's api guarantees, https://etcd.io/docs/v3.4/learning/api_guarantees/).
//! The [`Mirror`] holds the two keys as last read, updated a whole response
//! at a time; a [`Version`] orders profiles by generation, then by the
//! profile key's revision (a profile written by hand, without a bump, is
//! still newer), so an agent acts only on a version above the one it last
//! handled and never goes back.

use serde::{Deserialize, Serialize};

/// A profile's place in the publish history. Ordered by generation first.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Version {
    /// The generation key's value (0: no generation key).
    pub generation: u64,
    /// The profile key's `mod_revision`.
    pub revision: i64,
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "generation {} at revision {}", self.generation, self.revision)
    }
}

/// A complete profile as etcd holds it, not yet validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub version: Version,
    /// The profile key, as errors name it (`etcd://ENDPOINTS/PREFIX/profile`).
    pub label: String,
    pub text: String,
    pub hash: String,
}

/// What a key of the watched range did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    Put { key: String, value: Vec<u8>, mod_revision: i64 },
    Delete { key: String },
}

/// The `profile` and `generation` keys as last read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Mirror {
    profile: Option<(Vec<u8>, i64)>,
    generation: Option<Vec<u8>>,
}

impl Mirror {
    /// The keys of a Get of the prefix, as (key, value, mod_revision);
    /// others (the agents' reports) are ignored.
    pub fn from_get<'a>(
        profile_key: &str,
        generation_key: &str,
        kvs: impl IntoIterator<Item = (&'a str, &'a [u8], i64)>,
    ) -> Self {
        let mut m = Self::default();
        for (k, v, rev) in kvs {
            if k == profile_key {
                m.profile = Some((v.to_vec(), rev));
            } else if k == generation_key {
                m.generation = Some(v.to_vec());
            }
        }
        m
    }

    /// Applies one watch response's changes, in order.
    pub fn apply(&mut self, profile_key: &str, generation_key: &str, changes: &[Change]) {
        for c in changes {
            match c {
                Change::Put { key, value, mod_revision } if key == profile_key => {
                    self.profile = Some((value.clone(), *mod_revision))
                }
                Change::Put { key, value, .. } if key == generation_key => {
                    self.generation = Some(value.clone())
                }
                Change::Delete { key } if key == profile_key => self.profile = None,
                Change::Delete { key } if key == generation_key => self.generation = None,
                _ => {}
            }
        }
    }

    /// The profile the keys hold now, or why there is none to apply.
    pub fn candidate(&self, label: &str) -> Result<Candidate, String> {
        let Some((value, revision)) = &self.profile else {
            return Err(format!(
                "{label}: no profile there (publish one with `flowctl publish`); keeping the running profile"
            ));
        };
        let generation = match &self.generation {
            None => 0,
            Some(g) => parse_generation(g).ok_or_else(|| {
                format!(
                    "{label}: the generation key holds `{}`, not a number; keeping the running profile",
                    String::from_utf8_lossy(g)
                )
            })?,
        };
        let text = String::from_utf8(value.clone()).map_err(|e| {
            format!("{label}: the profile is not UTF-8 ({e}); keeping the running profile")
        })?;
        let hash = profile_hash(&text);
        Ok(Candidate {
            version: Version { generation, revision: *revision },
            label: label.to_string(),
            text,
            hash,
        })
    }

    /// The generation a publish bumps from, if the key holds a number.
    pub fn generation(&self) -> Option<u64> {
        self.generation.as_deref().and_then(parse_generation)
    }
}

pub fn parse_generation(v: &[u8]) -> Option<u64> {
    std::str::from_utf8(v).ok()?.trim().parse().ok()
}

/// What the agent does with a version it is offered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Newer than anything handled: validate and apply it.
    Take,
    /// Already applied or already rejected: nothing to do.
    Seen,
    /// Older than what was handled (a generation key set back by hand):
    /// never applied.
    Older,
}

/// `handled`: the newest version applied or rejected so far.
pub fn judge(handled: Option<Version>, offered: Version) -> Verdict {
    match handled {
        None => Verdict::Take,
        Some(h) if offered > h => Verdict::Take,
        Some(h) if offered == h => Verdict::Seen,
        Some(_) => Verdict::Older,
    }
}

/// The revision to resume a watch after, from one response's events: the
/// last event's revision. Never from a progress notification's header:
/// etcd 3.4 answers a progress request with the store's current revision
/// (its `ctrlStream`, for every watch of the stream), which can run ahead
/// of events still queued for a watch that is catching up; resuming after
/// it could skip a publish. Never goes back.
pub fn seen_after(seen: i64, event_revisions: &[i64]) -> i64 {
    event_revisions.iter().copied().fold(seen, i64::max)
}

/// The profile's identity across the fleet: SHA-256 of its text, the first
/// 16 hex digits (enough to tell versions apart; not a security check).
pub fn profile_hash(text: &str) -> String {
    use sha2::{Digest, Sha256};
    let d = Sha256::digest(text.as_bytes());
    d.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: &str = "/f/profile";
    const G: &str = "/f/generation";

    fn put(key: &str, value: &str, rev: i64) -> Change {
        Change::Put { key: key.into(), value: value.as_bytes().to_vec(), mod_revision: rev }
    }

    #[test]
    fn a_get_gives_the_profile_and_its_generation() {
        let kvs = [
            ("/f/agents/a", b"{}".as_slice(), 9),
            (G, b"4".as_slice(), 7),
            (P, b"[[rule]]".as_slice(), 7),
        ];
        let m = Mirror::from_get(P, G, kvs);
        let c = m.candidate("L").unwrap();
        assert_eq!(c.version, Version { generation: 4, revision: 7 });
        assert_eq!((c.text.as_str(), c.label.as_str()), ("[[rule]]", "L"));
        assert_eq!(c.hash, profile_hash("[[rule]]"));
        assert_eq!(m.generation(), Some(4));
    }

    #[test]
    fn one_response_of_a_publish_moves_both_keys_at_once() {
        let mut m = Mirror::from_get(P, G, [(G, b"1".as_slice(), 3), (P, b"a".as_slice(), 3)]);
        m.apply(P, G, &[put(P, "b", 8), put(G, "2", 8), put("/f/agents/x", "{}", 8)]);
        let c = m.candidate("L").unwrap();
        assert_eq!((c.version, c.text.as_str()), (Version { generation: 2, revision: 8 }, "b"));
        m.apply(P, G, &[Change::Delete { key: P.into() }]);
        assert!(m.candidate("L").unwrap_err().contains("no profile there"));
    }

    #[test]
    fn missing_or_garbled_keys_are_errors_that_keep_the_running_profile() {
        let m = Mirror::from_get(P, G, [(P, b"a".as_slice(), 2)]);
        assert_eq!(m.candidate("L").unwrap().version, Version { generation: 0, revision: 2 });
        let m = Mirror::from_get(P, G, [(P, b"a".as_slice(), 2), (G, b"x".as_slice(), 2)]);
        let e = m.candidate("L").unwrap_err();
        assert!(e.starts_with("L:") && e.contains("not a number") && e.contains("keeping"), "{e}");
        let m = Mirror::from_get(P, G, [(P, [0xff, 0xfe].as_slice(), 2)]);
        assert!(m.candidate("L").unwrap_err().contains("not UTF-8"));
    }

    #[test]
    fn versions_order_by_generation_then_revision_and_never_go_back() {
        let v = |g, r| Version { generation: g, revision: r };
        assert_eq!(judge(None, v(0, 1)), Verdict::Take);
        assert_eq!(judge(Some(v(2, 10)), v(3, 11)), Verdict::Take);
        assert_eq!(judge(Some(v(2, 10)), v(2, 12)), Verdict::Take, "a write without a bump");
        assert_eq!(judge(Some(v(2, 10)), v(2, 10)), Verdict::Seen, "a relist of the same");
        assert_eq!(judge(Some(v(3, 10)), v(2, 15)), Verdict::Older, "generation set back");
        assert_eq!(judge(Some(v(3, 10)), v(3, 9)), Verdict::Older);
    }

    #[test]
    fn the_resume_revision_follows_events_only_and_never_goes_back() {
        assert_eq!(seen_after(5, &[7, 9]), 9);
        assert_eq!(seen_after(5, &[]), 5, "a progress notification moves nothing");
        assert_eq!(seen_after(30, &[12]), 30);
    }

    #[test]
    fn the_hash_is_stable_and_short() {
        assert_eq!(profile_hash("a"), profile_hash("a"));
        assert_ne!(profile_hash("a"), profile_hash("b"));
        // SHA-256("abc") starts ba7816bf8f01cfea (FIPS 180-2, appendix B.1).
        assert_eq!(profile_hash("abc"), "ba7816bf8f01cfea");
    }
}
