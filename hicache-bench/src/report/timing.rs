//! How long the main job took on this machine: the wall time of each table's runs and of the
//! whole job. Runs of different tables may overlap (see `cmd::multiturn`), so a table's wall
//! time is the time at least one of its runs ran, not the sum of its runs' times.

use serde::Serialize;

/// When one run ran, in seconds since the job started.
#[derive(Copy, Clone, Debug, Default, PartialEq, Serialize)]
pub struct Span {
    /// Start (s).
    pub start: f64,
    /// End (s), not before the start.
    pub end: f64,
}

impl Span {
    /// The span from `start` to `end` (an end before the start is taken as the start).
    pub fn new(start: f64, end: f64) -> Self {
        Self {
            start,
            end: end.max(start),
        }
    }

    /// Seconds covered by at least one of `spans` (overlaps counted once).
    pub fn union_seconds(spans: impl IntoIterator<Item = Span>) -> f64 {
        let mut spans: Vec<Span> = spans.into_iter().collect();
        spans.sort_by(|a, b| a.start.total_cmp(&b.start));
        let mut total = 0.0;
        let mut open: Option<Span> = None;
        for s in spans {
            open = match open {
                Some(o) if s.start <= o.end => Some(Span::new(o.start, o.end.max(s.end))),
                Some(o) => {
                    total += o.end - o.start;
                    Some(s)
                }
                None => Some(s),
            };
        }
        total + open.map_or(0.0, |o| o.end - o.start)
    }
}

/// The wall time of one table's runs.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TableSeconds {
    /// The table (`dense`, `hybrid`).
    pub table: String,
    /// Seconds at least one of its runs ran.
    pub seconds: f64,
}

impl TableSeconds {
    /// `table` took `seconds`.
    pub fn new(table: &str, seconds: f64) -> Self {
        Self {
            table: table.to_string(),
            seconds,
        }
    }
}

/// How long the main job took.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Timing {
    /// Each table's wall time, in the order the tables print.
    pub tables: Vec<TableSeconds>,
    /// The whole job, from validating the arguments to the report (s).
    pub total_seconds: f64,
    /// Threads the runs whose figures do not depend on this machine's speed shared.
    pub threads: usize,
    /// Runs that measure GB/s at a time (1: each alone).
    pub measured_threads: usize,
}

impl Timing {
    /// The wall time of `table`, if it ran.
    pub fn table(&self, table: &str) -> Option<f64> {
        self.tables
            .iter()
            .find(|t| t.table == table)
            .map(|t| t.seconds)
    }

    /// The line printed under `table`: its wall time, if it ran.
    pub fn table_line(&self, table: &str) -> Option<String> {
        self.table(table)
            .map(|s| format!("wall time of this table's runs: {s:.1} s"))
    }

    /// The job's last line: its wall time and how its runs shared the machine.
    pub fn total_line(&self) -> String {
        let measured = match self.measured_threads {
            0 | 1 => "alone".to_string(),
            n => format!("{n} at a time"),
        };
        format!(
            "main job wall time: {:.1} s (runs whose figures do not depend on this machine's \
             speed side by side on {} thread(s), the runs that measure GB/s {measured})",
            self.total_seconds, self.threads
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlapping_spans_count_once() {
        let spans = [
            Span::new(0.0, 2.0),
            Span::new(1.0, 3.0),
            Span::new(5.0, 6.0),
            Span::new(5.5, 5.7),
        ];
        assert!((Span::union_seconds(spans) - 4.0).abs() < 1e-12);
        assert_eq!(Span::union_seconds([]), 0.0);
        assert_eq!(Span::new(3.0, 1.0).end, 3.0);
    }

    #[test]
    fn lines_name_the_tables_that_ran() {
        let t = Timing {
            tables: vec![TableSeconds::new("dense", 12.34)],
            total_seconds: 20.0,
            threads: 2,
            measured_threads: 2,
        };
        assert_eq!(
            t.table_line("dense").unwrap(),
            "wall time of this table's runs: 12.3 s"
        );
        assert!(t.table_line("hybrid").is_none());
        assert!(t.total_line().contains("20.0 s"), "{}", t.total_line());
        assert!(
            t.total_line().ends_with("2 at a time)"),
            "{}",
            t.total_line()
        );
    }
}
