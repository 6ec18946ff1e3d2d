//! `flowctl publish`: one profile to every agent of a prefix, as one etcd
//! transaction that writes the profile and bumps the generation, guarded
//! by the generation's revision as last read, so two publishers racing
//! cannot both bump from the same generation (the loser reads again and
//! retries), and every agent sees the whole change in one watch response.

use crate::fleet::etcd::{
    access::{request, Access},
    url::EtcdUrl,
    version::parse_generation,
};
use anyhow::{bail, Result};
use etcd_client::{Compare, CompareOp, Txn, TxnOp};

/// The transaction, as data (so its shape is testable without etcd).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// If the generation key's `mod_revision` still equals this (0: the key
    /// does not exist; etcd compares a missing key's revisions as 0)...
    pub generation_key: String,
    pub expect_mod_revision: i64,
    /// ...then put these, in one revision.
    pub puts: Vec<(String, String)>,
    pub generation: u64,
}

/// The plan for publishing `text` over a generation key last read as
/// `seen` (its value and `mod_revision`; `None`: absent).
pub fn plan(url: &EtcdUrl, text: &str, seen: Option<(Option<u64>, i64)>) -> Result<Plan> {
    let (current, mod_revision) = match seen {
        None => (0, 0),
        Some((Some(g), rev)) => (g, rev),
        Some((None, _)) => bail!(
            "{}: the generation key does not hold a number; fix it by hand (etcdctl put {} N) before publishing",
            url.label(&url.generation_key()),
            url.generation_key()
        ),
    };
    let generation = current + 1;
    Ok(Plan {
        generation_key: url.generation_key(),
        expect_mod_revision: mod_revision,
        puts: vec![
            (url.profile_key(), text.to_string()),
            (url.generation_key(), generation.to_string()),
        ],
        generation,
    })
}

impl Plan {
    pub fn txn(&self) -> Txn {
        Txn::new()
            .when([Compare::mod_revision(
                self.generation_key.clone(),
                CompareOp::Equal,
                self.expect_mod_revision,
            )])
            .and_then(
                self.puts
                    .iter()
                    .map(|(k, v)| TxnOp::put(k.clone(), v.clone(), None))
                    .collect::<Vec<_>>(),
            )
    }
}

/// What a publish did.
#[derive(Debug, PartialEq, Eq)]
pub struct Published {
    pub generation: u64,
    pub revision: i64,
}

/// Writes `text` (already validated) under `url`'s prefix.
pub async fn publish(url: &EtcdUrl, access: &Access, text: &str) -> Result<Published> {
    let mut client = access.connect(url).await?;
    // A few rounds against concurrent publishers; each lost round means
    // another publish went in first.
    for _ in 0..5 {
        let get = client.get(url.generation_key(), None);
        let resp = request(url, access, "reading the generation", get).await?;
        let seen = resp.kvs().first().map(|kv| (parse_generation(kv.value()), kv.mod_revision()));
        let p = plan(url, text, seen)?;
        let txn = request(url, access, "publishing", client.txn(p.txn())).await?;
        if txn.succeeded() {
            let revision = txn.header().map(|h| h.revision()).unwrap_or(0);
            return Ok(Published { generation: p.generation, revision });
        }
    }
    bail!("{}: other publishers kept winning the race; try again", url)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_transaction_guarded_by_the_generation_writes_profile_and_bump() {
        let url: EtcdUrl = "etcd://h/f/web".parse().unwrap();
        let p = plan(&url, "[[rule]]", Some((Some(6), 41))).unwrap();
        assert_eq!(p.generation, 7);
        assert_eq!(p.expect_mod_revision, 41);
        assert_eq!(
            p.puts,
            [
                ("/f/web/profile".to_string(), "[[rule]]".to_string()),
                ("/f/web/generation".to_string(), "7".to_string())
            ]
        );
        // The wire form: one compare, the two puts on success, nothing else.
        let wire = format!("{:?}", p.txn());
        assert_eq!(wire.matches("key: [").count(), 3, "{wire}");
        assert!(wire.contains("failure: []"), "{wire}");
        // The first publish: the key is absent, compared as revision 0.
        let p = plan(&url, "x", None).unwrap();
        assert_eq!((p.generation, p.expect_mod_revision), (1, 0));
        let e = plan(&url, "x", Some((None, 3))).unwrap_err().to_string();
        assert!(e.contains("does not hold a number"), "{e}");
    }
}
