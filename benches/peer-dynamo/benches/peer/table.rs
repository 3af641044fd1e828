//! The Markdown table of the side-by-side bench: one column per case, one row per
//! figure; a cell is the per-round ratio ours / Dynamo's as median (min–max), then
//! the median figures of both.

use crate::flood::Flood;
use crate::run::{Figures, spread};
use crate::{Column, Dynamo, DynamoSingle, Library, Ours};

/// Which of Dynamo's trees a row compares with.
#[derive(Clone, Copy)]
enum Peer {
    Concurrent,
    Single,
}

fn millions(x: f64) -> String {
    format!("{:.2}M", x / 1e6)
}

fn micros(x: f64) -> String {
    format!("{x:.1} µs")
}

fn cell(ours: &[f64], theirs: &[f64], fmt: fn(f64) -> String) -> String {
    let ratios = ours.iter().zip(theirs).map(|(a, b)| a / b).collect();
    let [lo, mid, hi] = spread(ratios);
    let (a, b) = (spread(ours.to_vec())[1], spread(theirs.to_vec())[1]);
    format!(" **{mid:.2}** ({lo:.2}–{hi:.2}; {} / {}) |", fmt(a), fmt(b))
}

fn row(
    columns: &[Column],
    name: &str,
    peer: Peer,
    get: impl Fn(&Figures) -> f64,
    fmt: fn(f64) -> String,
) {
    print!("| {name} |");
    for c in columns {
        let theirs = match peer {
            Peer::Concurrent => &c.dynamo,
            Peer::Single => &c.single,
        };
        let ours: Vec<f64> = c.ours.iter().map(&get).collect();
        let theirs: Vec<f64> = theirs.iter().map(&get).collect();
        print!("{}", cell(&ours, &theirs, fmt));
    }
    println!();
}

fn memory_row(columns: &[Column], name: &str, ours: usize, theirs: usize) {
    print!("| {name} |");
    for c in columns {
        let (a, b) = (c.memory[ours], c.memory[theirs]);
        print!(" **{:.2}** ({a:.0} / {b:.0}) |", a / b);
    }
    println!();
}

/// Prints the table of `columns`, measured under `floods` (only the bare-tree rows
/// when `bare_only`).
pub fn print(columns: &[Column], floods: &[Flood], bare_only: bool) {
    print!("| figure |");
    for c in columns {
        print!(" {} |", c.name);
    }
    print!("\n|---|");
    for _ in columns {
        print!("---|");
    }
    println!();
    let (con, single) = (Peer::Concurrent, Peer::Single);
    let apply = "apply, bare tree, 1 thread, blocks/s (higher is better)";
    row(columns, apply, con, |f| f.apply, millions);
    let apply1 = "apply, bare tree, vs Dynamo's single-threaded RadixTree (higher is better)";
    row(columns, apply1, single, |f| f.apply, millions);
    let cpu = "apply, bare tree, per second on a CPU (higher is better)";
    row(columns, cpu, con, |f| f.apply_cpu, millions);
    let cpu1 = "apply, bare tree, per second on a CPU, vs Dynamo's RadixTree";
    row(columns, cpu1, single, |f| f.apply_cpu, millions);
    row(columns, "query p50, bare tree", con, |f| f.bare_p50, micros);
    let p50 = "query p50, bare tree, vs Dynamo's RadixTree";
    row(columns, p50, single, |f| f.bare_p50, micros);
    memory_row(columns, "RSS bytes per entry, bare tree", 0, 1);
    memory_row(columns, "RSS bytes per entry, vs Dynamo's RadixTree", 0, 4);
    if bare_only {
        wrong_rows(columns);
        return;
    }
    memory_row(columns, "RSS bytes per entry, production front", 2, 3);
    let ingest = "bulk ingest via the front, 2 threads, blocks/s (higher is better)";
    row(columns, ingest, con, |f| f.ingest, millions);
    row(
        columns,
        "front query p50, idle",
        con,
        |f| f.front_p50,
        micros,
    );
    row(
        columns,
        "front query p99, idle",
        con,
        |f| f.front_p99,
        micros,
    );
    for (i, flood) in floods.iter().enumerate() {
        row(columns, &flood.title(), con, |f| f.flood_p99[i], micros);
        let p999 = flood.title().replace("p99", "p99.9");
        row(columns, &p999, con, |f| f.flood_p999[i], micros);
    }
    for (i, flood) in floods.iter().enumerate() {
        print!(
            "| flood achieved (ours / Dynamo's), {} |",
            flood.title().trim_start_matches("front query p99, ")
        );
        for c in columns {
            let median = |v: &[Figures]| spread(v.iter().map(|f| f.flood_rate[i]).collect())[1];
            print!(
                " {} / {} |",
                millions(median(&c.ours)),
                millions(median(&c.dynamo))
            );
        }
        println!();
    }
    wrong_rows(columns);
}

/// The wrong-answer row, and up to three examples per library on stderr.
fn wrong_rows(columns: &[Column]) {
    print!("| wrong answers (ours / Dynamo's / Dynamo's RadixTree, of all checked) |");
    for c in columns {
        let [a, b, s] = &c.wrong;
        print!(
            " {} / {} / {} of {} |",
            a.count, b.count, s.count, a.checked
        );
    }
    println!();
    for c in columns {
        let names = [Ours::NAME, Dynamo::NAME, DynamoSingle::NAME];
        for (who, w) in names.into_iter().zip(&c.wrong) {
            for e in &w.examples {
                eprintln!("{}: {who} wrong: {e}", c.name);
            }
        }
    }
}
