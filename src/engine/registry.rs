//! The nodes recorded in Lazy mode and not known to be finished: what `wait_all`,
//! backpressure and a retiring engine demand, and what DOT export shows.
//!
//! A node that waits for the one its thread registered last takes that one's
//! place (everything that walks the registry follows dependencies), so a chain
//! keeps one entry, not one per node.
//!
//! One shard per recording thread (threads are spread over the shards round-robin),
//! so frontends recording at the same time do not contend; a shard drops its
//! finished nodes when it has doubled since the last time (amortized O(1)).

use super::NodeRef;
use crate::sync::{lock, Mutex};
use crossbeam_utils::CachePadded;

const SHARDS: usize = 8;
const PRUNE_MIN: usize = 64;

struct Shard {
    nodes: Vec<NodeRef>,
    prune_at: usize,
}

pub(crate) struct Registry {
    shards: [CachePadded<Mutex<Shard>>; SHARDS],
}

impl Default for Registry {
    fn default() -> Self {
        Registry {
            shards: std::array::from_fn(|_| {
                CachePadded::new(Mutex::new(Shard {
                    nodes: Vec::new(),
                    prune_at: PRUNE_MIN,
                }))
            }),
        }
    }
}

fn my_shard() -> usize {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    thread_local! {
        static SHARD: usize = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % SHARDS;
    }
    SHARD.with(|s| *s)
}

impl Registry {
    pub(crate) fn push(&self, node: &NodeRef) {
        let mut s = lock(&self.shards[my_shard()]);
        if let Some(last) = s.nodes.last_mut() {
            if node.waits_for(last) {
                *last = node.clone();
                return;
            }
        }
        if s.nodes.len() >= s.prune_at {
            s.nodes.retain(|n| !n.is_done());
            s.prune_at = (s.nodes.len() * 2).max(PRUNE_MIN);
        }
        s.nodes.push(node.clone());
    }

    /// Calls `f` on each shard's nodes, under that shard's lock (records on
    /// other threads go on).
    pub(crate) fn for_each(&self, mut f: impl FnMut(&[NodeRef])) {
        for shard in &self.shards {
            let mut s = lock(shard);
            s.nodes.retain(|n| !n.is_done());
            s.prune_at = (s.nodes.len() * 2).max(PRUNE_MIN);
            f(&s.nodes);
        }
    }

    /// The unfinished nodes, in record order per shard.
    pub(crate) fn snapshot(&self) -> Vec<NodeRef> {
        let mut out = Vec::new();
        self.for_each(|nodes| out.extend(nodes.iter().cloned()));
        out
    }
}
