//! Stage 4 for a flooded rule's keys without a bucket: the flood sketch the
//! agent lent the rule (its control record's `sketch`; the agent's `flood`
//! loop). Such a key is decided by the sketch's estimate of its TAT, and
//! admitting raises its cells (`flowctl_common::sketch`, docs/algorithms.md
//! 1.9): no bucket is created, so a flood of more distinct keys than the
//! tables hold neither evicts live keys nor hands each returning key a
//! fresh burst. Keys that have a bucket keep it. Where every new bucket of
//! a plain rule starts (its key's debt, and the sketch's estimate) is
//! decided here too.

use super::agent_alive;
use crate::{
    accounting::counters,
    maps::{
        packet, FLOWCTL_CONTROL, FLOWCTL_DEBT, FLOWCTL_GLOBAL, FLOWCTL_RULES, FLOWCTL_SKETCHES,
    },
};
use flowctl_common::{
    control_flags, debt, gcra,
    keys::bucket_key,
    sketch::{self, SKETCH_COLUMNS, SKETCH_POOL, SKETCH_ROWS},
    CAS_RETRIES,
};

/// `flowctl_new_key`'s answers besides a starting TAT (a TAT is a time
/// in ns, far below these).
pub const REFUSED: u64 = u64::MAX;
pub const ADMITTED: u64 = u64::MAX - 1;

/// A key without a bucket under the rule at `rule_at`, for the packet in
/// flight: where its new bucket starts, or, with `decide` set (`inc` ns
/// per packet) and a sketch lent to the rule, the sketch's verdict
/// (`ADMITTED`, charged, or `REFUSED`; no bucket is made).
///
/// The start is the key's remembered debt (`FLOWCTL_DEBT`, as
/// `flowctl_recall_debt`), and, while the rule holds a sketch or drains
/// one (`control_flags::SKETCH_DRAINING`: the flood is over and the
/// agent takes the sketch back one burst later), no earlier than the
/// sketch's estimate: a key the sketch refused does not graduate to a full
/// bucket. The sketch's verdict counts the debt as a cell too, so a key
/// refused before the flood was noticed stays refused. Without a sketch,
/// or once the agent's heartbeat is older than the grace period, it is
/// the debt alone.
///
/// A global function that builds the key itself, as the debt table's: its
/// two hashes are verified once, not once per path into stage 4. The cells
/// are charged before the quota commits: a packet the quota then refuses
/// (another CPU filled the window between its look and its commit) leaves
/// its charge in the sketch, which only ever refuses more.
#[no_mangle]
#[inline(never)]
pub extern "C" fn flowctl_new_key(
    rule_at: u32,
    record: u32,
    now: u64,
    inc: u64,
    decide: u64,
) -> u64 {
    let (Some(global), Some(rule), Some(meta), Some(ctl)) =
        (FLOWCTL_GLOBAL.get(0), FLOWCTL_RULES.get(rule_at), packet(), FLOWCTL_CONTROL.get(record))
    else {
        return 0;
    };
    let key = bucket_key(meta, rule);
    let (set, tag) = debt::locate(global.hash_seed, record, &key);
    let debt = match FLOWCTL_DEBT.get(set) {
        Some(s) => debt::recall(s, tag, now),
        None => 0,
    };
    let lent = ctl.sketch;
    if lent == 0 || lent > SKETCH_POOL || !agent_alive(global, now) {
        return debt;
    }
    let columns = sketch::cells(global.hash_seed, &key, SKETCH_COLUMNS);
    // The key's TAT as the sketch knows it: the least of its cells.
    let mut estimate = u64::MAX;
    let mut row = 0;
    while row < SKETCH_ROWS {
        let i = sketch::cell_index(lent - 1, row as u32, columns[row]);
        let cell = match FLOWCTL_SKETCHES.get(i) {
            Some(c) => unsafe { core::ptr::read_volatile(c) },
            None => 0,
        };
        if cell < estimate {
            estimate = cell;
        }
        row += 1;
    }
    let tat = if debt > estimate { debt } else { estimate };
    if decide == 0 || ctl.flags & control_flags::SKETCH_DRAINING != 0 {
        return tat;
    }
    if let Some(c) = counters(record) {
        c.sketched_pkts += 1;
    }
    let Some(new) = gcra::admit(tat, now, inc, rule.burst_ns) else { return REFUSED };
    let mut row = 0;
    while row < SKETCH_ROWS {
        if let Some(p) =
            FLOWCTL_SKETCHES.get_ptr_mut(sketch::cell_index(lent - 1, row as u32, columns[row]))
        {
            raise(p, new);
        }
        row += 1;
    }
    ADMITTED
}

/// Raises a cell to `new` if it is below (`sketch::raised`), by
/// compare-and-swap: a cell another CPU raised meanwhile is raised from
/// where it went. Lost `CAS_RETRIES` times, the cell keeps a value another
/// CPU wrote since the read, itself an admission's TAT.
#[inline(always)]
fn raise(cell: *mut u64, new: u64) {
    let mut tries = 0;
    while tries < CAS_RETRIES {
        let old = unsafe { core::ptr::read_volatile(cell) };
        if sketch::raised(old, new) == old {
            return;
        }
        let (_, ok) = unsafe { crate::atomic::cxchg(cell, old, new) };
        if ok {
            return;
        }
        tries += 1;
    }
}
