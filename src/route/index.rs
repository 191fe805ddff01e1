//! A lookup index from a string key to the route that claims it, holding no copy of the
//! key: open addressing over `(hash tag, route, key position)` slots, where the key itself
//! is read back from the route. A 10,000-route table indexes some 60,000 keys; as
//! `HashMap<String, usize>` they cost more memory than the routes themselves.

use std::hash::{BuildHasher, RandomState};

/// Where an index finds a key inside the routes: `(route, position)` to the key string.
pub(super) trait Keys {
    fn key(&self, route: u32, position: u32) -> &str;
}

/// Open-addressing (linear probing) index, at most half full. Probes walk a dense array
/// of 16-bit hash tags (a miss rarely leaves it); only a matching tag reads the entry and
/// compares the key.
#[derive(Debug)]
pub(super) struct Index {
    /// 0 for an empty slot, else the high hash bits with the top bit set.
    tags: Vec<u16>,
    /// `(route, position)` of the key in each occupied slot.
    entries: Vec<(u32, u32)>,
    len: usize,
    hasher: RandomState,
}

impl Default for Index {
    fn default() -> Self {
        Index::with_capacity(0)
    }
}

impl Index {
    /// An index for about `keys` keys.
    pub(super) fn with_capacity(keys: usize) -> Self {
        let size = (keys * 2).max(8).next_power_of_two();
        Index {
            tags: vec![0; size],
            entries: vec![(0, 0); size],
            len: 0,
            hasher: RandomState::new(),
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first slot to probe and the tag for `key`.
    fn hash(&self, key: &str) -> (usize, u16) {
        let h = self.hasher.hash_one(key);
        (
            h as usize & (self.tags.len() - 1),
            (h >> 48) as u16 | 0x8000,
        )
    }

    /// Indexes `key` (at `position` in `route`). Returns the route that already claims an
    /// equal key, if any; then nothing is inserted.
    pub(super) fn insert(
        &mut self,
        keys: &impl Keys,
        key: &str,
        route: u32,
        position: u32,
    ) -> Option<u32> {
        if (self.len + 1) * 2 > self.tags.len() {
            self.grow(keys);
        }
        match self.find(keys, key) {
            Ok(i) => Some(self.entries[i].0),
            Err((i, tag)) => {
                self.tags[i] = tag;
                self.entries[i] = (route, position);
                self.len += 1;
                None
            }
        }
    }

    /// The route claiming `key`.
    pub(super) fn get(&self, keys: &impl Keys, key: &str) -> Option<u32> {
        self.find(keys, key).ok().map(|i| self.entries[i].0)
    }

    /// The slot holding `key`, or the empty slot (and tag) where it would go.
    fn find(&self, keys: &impl Keys, key: &str) -> Result<usize, (usize, u16)> {
        let (mut i, tag) = self.hash(key);
        let mask = self.tags.len() - 1;
        // At most half full: an empty slot always ends the probe.
        loop {
            match self.tags[i] {
                0 => return Err((i, tag)),
                t if t == tag => {
                    let (r, p) = self.entries[i];
                    if keys.key(r, p) == key {
                        return Ok(i);
                    }
                }
                _ => {}
            }
            i = (i + 1) & mask;
        }
    }

    fn grow(&mut self, keys: &impl Keys) {
        let mut bigger = Index::with_capacity(self.tags.len());
        bigger.hasher = self.hasher.clone();
        for (i, &t) in self.tags.iter().enumerate() {
            if t != 0 {
                let (r, p) = self.entries[i];
                let _ = bigger.insert(keys, keys.key(r, p), r, p);
            }
        }
        *self = bigger;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Table(Vec<Vec<String>>);

    impl Keys for Table {
        fn key(&self, route: u32, position: u32) -> &str {
            &self.0[route as usize][position as usize]
        }
    }

    #[test]
    fn finds_every_key_and_reports_claims() {
        let routes: Vec<Vec<String>> = (0..3000)
            .map(|r| (0..3).map(|k| format!("key-{r}-{k}")).collect())
            .collect();
        let table = Table(routes);
        // Start small so the index grows several times.
        let mut index = Index::with_capacity(1);
        for (r, keys) in table.0.iter().enumerate() {
            for (k, key) in keys.iter().enumerate() {
                assert_eq!(index.insert(&table, key, r as u32, k as u32), None);
            }
        }
        for (r, keys) in table.0.iter().enumerate() {
            for key in keys {
                assert_eq!(index.get(&table, key), Some(r as u32));
            }
        }
        assert_eq!(index.get(&table, "key-3000-0"), None);
        assert_eq!(index.get(&table, ""), None);
        assert_eq!(index.insert(&table, "key-17-2", 5, 0), Some(17));
        assert!(!index.is_empty());
        assert!(Index::default().is_empty());
    }
}
