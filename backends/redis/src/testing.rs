//! Real `redis-server` processes on loopback for tests and benches (feature `testing`): a
//! standalone server ([`RedisServer`]) and a cluster of primaries with replicas
//! ([`RedisCluster`], created with `redis-cli --cluster create`). Every wait is bounded;
//! processes are killed when their handle drops.
//!
//! Tests call [`redis_available`] first: where `redis-server` is missing it prints a line
//! saying the test is skipped, unless `HICACHE_REQUIRE_REDIS=1` (set by CI), where it panics.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Whether `redis-server` and `redis-cli` can be run. Prints why a test is skipped, or panics
/// where `HICACHE_REQUIRE_REDIS=1`.
pub fn redis_available(test: &str) -> bool {
    let ok = ["redis-server", "redis-cli"].iter().all(|b| {
        Command::new(b)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    });
    if !ok {
        if std::env::var("HICACHE_REQUIRE_REDIS").as_deref() == Ok("1") {
            panic!("{test}: HICACHE_REQUIRE_REDIS=1 but redis-server / redis-cli cannot be run");
        }
        println!(
            "{test}: skipped: redis-server not found (apt-get install redis-server redis-tools)"
        );
    }
    ok
}

/// A port `p` on 127.0.0.1 free now, with `p + 10000` (the cluster bus port) free too.
fn free_port() -> u16 {
    for _ in 0..200 {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        let p = l.local_addr().expect("local addr").port();
        if p < 55_000 && TcpListener::bind(("127.0.0.1", p + 10_000)).is_ok() {
            return p;
        }
    }
    panic!("no free loopback port pair found");
}

/// One `redis-server` process on 127.0.0.1, killed on drop.
pub struct RedisServer {
    child: Option<Child>,
    /// Its port.
    pub port: u16,
    _dir: tempfile::TempDir,
}

impl RedisServer {
    /// Starts a standalone server with extra arguments (`["--requirepass", "x"]`).
    pub fn start(extra: &[&str]) -> Self {
        Self::start_mode(false, extra)
    }

    fn start_mode(cluster: bool, extra: &[&str]) -> Self {
        let mut last = String::new();
        for _ in 0..5 {
            let dir = tempfile::tempdir().expect("temp dir");
            let port = free_port();
            let mut cmd = Command::new("redis-server");
            cmd.arg("--port")
                .arg(port.to_string())
                .args([
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--protected-mode",
                    "no",
                ])
                .arg("--dir")
                .arg(dir.path());
            if cluster {
                cmd.args(["--cluster-enabled", "yes", "--cluster-node-timeout", "1500"])
                    .arg("--cluster-config-file")
                    .arg(dir.path().join("nodes.conf"));
            }
            cmd.args(extra).stdout(Stdio::null()).stderr(Stdio::null());
            let child = cmd.spawn().expect("spawn redis-server");
            let mut s = Self {
                child: Some(child),
                port,
                _dir: dir,
            };
            match s.wait_ready(extra) {
                Ok(()) => return s,
                Err(e) => {
                    last = e;
                    s.kill();
                }
            }
        }
        panic!("redis-server did not start: {last}");
    }

    fn wait_ready(&mut self, extra: &[&str]) -> Result<(), String> {
        let pass = extra
            .windows(2)
            .find(|w| w[0] == "--requirepass")
            .map(|w| w[1].to_string());
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                return Err(format!("exited with {status} on port {}", self.port));
            }
            let mut c = Command::new("redis-cli");
            c.args(["-h", "127.0.0.1", "-p", &self.port.to_string()]);
            if let Some(p) = &pass {
                c.args(["-a", p, "--no-auth-warning"]);
            }
            if c.arg("ping")
                .output()
                .is_ok_and(|o| o.stdout.starts_with(b"PONG"))
            {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        Err(format!("no PONG on port {} within 10 s", self.port))
    }

    /// `127.0.0.1:port`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// SIGKILLs the process (no-op if already gone).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Whether the process was killed.
    pub fn is_killed(&self) -> bool {
        self.child.is_none()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Runs `redis-cli -p port args…` and returns its standard output.
pub fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .expect("run redis-cli");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A Redis Cluster of `primaries` primaries with `replicas` replicas each, on loopback.
pub struct RedisCluster {
    /// Every node; the first `primaries` were created as primaries.
    pub servers: Vec<RedisServer>,
    primaries: usize,
}

impl RedisCluster {
    /// Starts the nodes, creates the cluster and waits until every node reports it healthy
    /// and every primary has its replicas attached.
    pub fn start(primaries: usize, replicas: usize, extra: &[&str]) -> Self {
        let n = primaries * (1 + replicas);
        let servers: Vec<RedisServer> = (0..n)
            .map(|_| RedisServer::start_mode(true, extra))
            .collect();
        let mut args: Vec<String> = vec!["--cluster".into(), "create".into()];
        args.extend(servers.iter().map(RedisServer::addr));
        args.extend([
            "--cluster-replicas".into(),
            replicas.to_string(),
            "--cluster-yes".into(),
        ]);
        let out = Command::new("redis-cli")
            .args(&args)
            .stdin(Stdio::null())
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let c = Self { servers, primaries };
        c.wait_healthy(Duration::from_secs(30));
        c
    }

    /// Seed addresses (every live node).
    pub fn seeds(&self) -> Vec<String> {
        self.servers
            .iter()
            .filter(|s| !s.is_killed())
            .map(RedisServer::addr)
            .collect()
    }

    /// Waits (bounded) until every live node reports `cluster_state:ok` with all slots served,
    /// and every primary that has replicas configured reports them attached. Panics on timeout.
    pub fn wait_healthy(&self, within: Duration) {
        let deadline = Instant::now() + within;
        let mut last = String::new();
        while Instant::now() < deadline {
            let live: Vec<&RedisServer> = self.servers.iter().filter(|s| !s.is_killed()).collect();
            let ok = live.iter().all(|s| {
                let info = cli(s.port, &["cluster", "info"]);
                last = info.clone();
                info.contains("cluster_state:ok") && info.contains("cluster_slots_ok:16384")
            });
            let attached = live.iter().all(|s| {
                let repl = cli(s.port, &["info", "replication"]);
                if repl.contains("role:master") {
                    let want = self.expected_replicas(s.port);
                    let got = repl
                        .lines()
                        .filter(|l| l.starts_with("slave") && l.contains("state=online"))
                        .count();
                    got >= want
                } else {
                    repl.contains("master_link_status:up")
                }
            });
            if ok && attached {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("cluster not healthy within {within:?}: {last}");
    }

    /// Replicas a live primary on `port` should have: those of its live replicas per
    /// `CLUSTER NODES`.
    fn expected_replicas(&self, port: u16) -> usize {
        let nodes = cli(port, &["cluster", "nodes"]);
        let Some(me) = nodes.lines().find(|l| l.contains("myself")) else {
            return 0;
        };
        let id = me.split_whitespace().next().unwrap_or_default();
        nodes
            .lines()
            .filter(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f.len() > 3 && f[3] == id && f[2].contains("slave") && !f[2].contains("fail")
            })
            .count()
    }

    /// The live node that is currently a primary owning slots, first found.
    pub fn a_primary(&self) -> usize {
        self.servers
            .iter()
            .position(|s| {
                !s.is_killed()
                    && cli(s.port, &["info", "replication"]).contains("role:master")
                    && self.expected_replicas(s.port) > 0
            })
            .unwrap_or(0)
    }

    /// SIGKILLs node `i`.
    pub fn kill(&mut self, i: usize) {
        self.servers[i].kill();
    }

    /// Number of primaries the cluster was created with.
    pub fn primaries(&self) -> usize {
        self.primaries
    }
}
