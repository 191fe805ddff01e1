//! Routing at seed scale, as criterion benches: lookups in a 10,000-route table, and
//! parsing, validating and indexing a 10,000-route table file (YAML and JSON).
//!
//! `cargo bench --bench routing` (criterion prints time per lookup and per table).
//! The gateway's memory and reload time with the same table: `--bench routing_scale`.
// A test or bench fails loudly on what it did not expect; its helpers are its own.
#![expect(
    clippy::unwrap_used,
    unreachable_pub,
    reason = "a test or bench fails loudly on what it did not expect; its helpers are its own"
)]

mod common;

use std::hint::black_box;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use common::{ROUTES, table_json, table_yaml};
use criterion::{Criterion, criterion_group, criterion_main};
use trellis::config::routes;
use trellis::route::BackendRegistry;

fn lookups(c: &mut Criterion) {
    let yaml = table_yaml(ROUTES, 0);
    let registry = BackendRegistry::default();
    let loaded = routes::parse(Path::new("routes.yaml"), yaml.as_bytes(), &registry).unwrap();
    let table = &loaded.table;
    let keys = |f: &dyn Fn(usize) -> String| (0..ROUTES).map(f).collect::<Vec<_>>();
    let exact = keys(&|i| format!("api.s{i}.p{i}.internal.example.com"));
    let wild = keys(&|i| format!("x.y.s{i}.p{i}.example.com"));
    let miss = keys(&|i| format!("api.s{i}.p{i}.unknown.example.org"));
    let dest =
        keys(&|i| format!("outbound|443||kube-apiserver.shoot--p{i}--s{i}.svc.cluster.local"));
    let pdst: Vec<SocketAddr> = (0..ROUTES)
        .map(|i| SocketAddr::from(([240, (i >> 16) as u8, (i >> 8) as u8, i as u8], 443)))
        .collect();

    let mut g = c.benchmark_group("lookup_10k_routes");
    // Each iteration looks up the next key, so the whole table is walked, not one entry.
    let mut i = 0usize;
    let mut next = move || {
        i = (i + 1) % ROUTES;
        i
    };
    g.bench_function("sni_exact", |b| {
        b.iter(|| assert!(table.by_sni(black_box(&exact[next()])).is_some()))
    });
    g.bench_function("sni_wildcard_2_labels_deep", |b| {
        b.iter(|| assert!(table.by_sni(black_box(&wild[next()])).is_some()))
    });
    g.bench_function("sni_miss", |b| {
        b.iter(|| assert!(table.by_sni(black_box(&miss[next()])).is_none()))
    });
    g.bench_function("connect_destination", |b| {
        b.iter(|| assert!(table.by_destination(black_box(&dest[next()])).is_some()))
    });
    g.bench_function("proxy_destination", |b| {
        b.iter(|| {
            assert!(
                table
                    .by_proxy_destination(black_box(&pdst[next()]))
                    .is_some()
            )
        })
    });
    g.finish();
}

fn parsing(c: &mut Criterion) {
    let yaml = table_yaml(ROUTES, 0);
    let json = table_json(ROUTES, 0);
    let mut g = c.benchmark_group("table_10k_routes");
    g.sample_size(10).measurement_time(Duration::from_secs(5));
    for (name, bytes) in [
        ("parse_validate_index_json", &json),
        ("parse_validate_index_yaml", &yaml),
    ] {
        g.bench_function(name, |b| {
            b.iter(|| {
                let registry = BackendRegistry::default();
                let t = routes::parse(Path::new("routes"), black_box(bytes.as_bytes()), &registry)
                    .unwrap();
                assert_eq!(t.table.routes().len(), ROUTES);
                t
            })
        });
    }
    g.finish();
}

criterion_group!(benches, lookups, parsing);
criterion_main!(benches);
