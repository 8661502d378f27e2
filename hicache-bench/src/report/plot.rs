//! SVG plots of a report (plotters): hit ratio per round, TTFT CDF per configuration, and
//! achieved bandwidth per transfer direction.

use std::path::Path;

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::report::summary::Summary;

const SIZE: (u32, u32) = (900, 520);

fn err(what: &str, path: &Path) -> impl Fn(String) -> String {
    let p = path.display().to_string();
    let w = what.to_string();
    move |e| format!("{p}: {w}: {e}")
}

fn colour(i: usize) -> RGBColor {
    // Distinguishable on white, in a fixed order: no cache, L1, L1+L2, L1+L2+L3.
    const C: [RGBColor; 6] = [
        RGBColor(110, 110, 110),
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
    ];
    C[i % C.len()]
}

/// Hit ratio (%) per round, one line per configuration (`offset` = colour index of the first).
pub fn hit_ratio_per_round(path: &Path, runs: &[Summary], offset: usize) -> Result<(), String> {
    let e = err("hit ratio plot", path);
    let rounds = runs
        .iter()
        .map(|s| s.rounds.len())
        .max()
        .unwrap_or(1)
        .max(1);
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(x.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Prompt tokens served from cache, per round",
            ("sans-serif", 22),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(55)
        .build_cartesian_2d(0.5f64..rounds as f64 + 0.5, 0f64..100f64)
        .map_err(|x| e(x.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("round")
        .y_desc("hit ratio (%)")
        .x_labels(rounds.min(20))
        .x_label_formatter(&|x| format!("{:.0}", x))
        .draw()
        .map_err(|x| e(x.to_string()))?;
    for (i, s) in runs.iter().enumerate() {
        let c = colour(i + offset);
        let pts: Vec<(f64, f64)> = s
            .rounds
            .iter()
            .map(|r| (r.round as f64 + 1.0, r.hit_ratio() * 100.0))
            .collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
            .map_err(|x| e(x.to_string()))?
            .label(s.label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        chart
            .draw_series(pts.into_iter().map(|p| Circle::new(p, 4, c.filled())))
            .map_err(|x| e(x.to_string()))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|x| e(x.to_string()))?;
    root.present().map_err(|x| e(x.to_string()))
}

/// Cumulative distribution of TTFT (ms), one line per configuration.
pub fn ttft_cdf(path: &Path, runs: &[Summary]) -> Result<(), String> {
    let e = err("TTFT plot", path);
    let max_ms = runs
        .iter()
        .map(|s| s.ttft.max * 1e3)
        .fold(0.0, f64::max)
        .max(1e-3)
        * 1.05;
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(x.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption("Time to first token (simulated), CDF", ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(55)
        .build_cartesian_2d(0f64..max_ms, 0f64..1f64)
        .map_err(|x| e(x.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("TTFT (ms)")
        .y_desc("fraction of requests")
        .draw()
        .map_err(|x| e(x.to_string()))?;
    for (i, s) in runs.iter().enumerate() {
        let c = colour(i);
        let n = s.ttft_sorted.len().max(1) as f64;
        let mut pts = vec![(0.0, 0.0)];
        for (k, t) in s.ttft_sorted.iter().enumerate() {
            let ms = t * 1e3;
            pts.push((ms, k as f64 / n));
            pts.push((ms, (k + 1) as f64 / n));
        }
        chart
            .draw_series(LineSeries::new(pts, c.stroke_width(2)))
            .map_err(|x| e(x.to_string()))?
            .label(s.label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|x| e(x.to_string()))?;
    root.present().map_err(|x| e(x.to_string()))
}

/// Achieved GB/s per transfer direction, one bar per configuration (`offset` = colour index of
/// the first).
pub fn bandwidth(path: &Path, runs: &[Summary], offset: usize) -> Result<(), String> {
    const DIRS: [&str; 4] = ["L1→L2 (D2H)", "L2→L1 (H2D)", "L2→L3", "L3→L2"];
    let e = err("bandwidth plot", path);
    let top = runs
        .iter()
        .flat_map(|s| s.transfers().map(|(_, t)| t.gbps()))
        .fold(0.0, f64::max)
        .max(0.1)
        * 1.4;
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(x.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Achieved bandwidth per direction (this machine)",
            ("sans-serif", 22),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(55)
        .build_cartesian_2d(0.5f64..4.5f64, 0f64..top)
        .map_err(|x| e(x.to_string()))?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(4)
        .x_label_formatter(&|x| {
            let i = x.round();
            if (x - i).abs() < 1e-9 && (1.0..=4.0).contains(&i) {
                DIRS[i as usize - 1].to_string()
            } else {
                String::new()
            }
        })
        .y_desc("GB/s")
        .draw()
        .map_err(|x| e(x.to_string()))?;
    let n = runs.len().max(1) as f64;
    let width = 0.8 / n;
    for (k, s) in runs.iter().enumerate() {
        let c = colour(k + offset);
        let bars: Vec<Rectangle<(f64, f64)>> = s
            .transfers()
            .iter()
            .enumerate()
            .map(|(d, (_, t))| {
                let x0 = d as f64 + 0.6 + k as f64 * width;
                Rectangle::new([(x0, 0.0), (x0 + width * 0.9, t.gbps())], c.filled())
            })
            .collect();
        chart
            .draw_series(bars)
            .map_err(|x| e(x.to_string()))?
            .label(s.label.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 15, y + 5)], c.filled()));
        let values = s
            .transfers()
            .into_iter()
            .enumerate()
            .filter(|(_, (_, t))| t.pages > 0);
        chart
            .draw_series(values.map(|(d, (_, t))| {
                let x = d as f64 + 0.6 + (k as f64 + 0.45) * width;
                let style = TextStyle::from(("sans-serif", 12).into_font())
                    .pos(Pos::new(HPos::Center, VPos::Bottom));
                Text::new(format!("{:.1}", t.gbps()), (x, t.gbps()), style)
            }))
            .map_err(|x| e(x.to_string()))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|x| e(x.to_string()))?;
    root.present().map_err(|x| e(x.to_string()))
}
