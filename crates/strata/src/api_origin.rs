//! Requests sent by web pages. Without an access token the admin API trusts whoever reaches
//! its loopback port, and a browser on the same host reaches it for any page it shows: a POST
//! with a `text/plain` body needs no CORS preflight, so a page of any site could create
//! volumes, take snapshots or roll a volume back (`"force": true` discards what was written
//! since), and a site whose name it points at 127.0.0.1 (DNS rebinding) could even delete.
//! Browsers name the page's origin in `Origin` on every POST, PUT and DELETE; the CLI, curl
//! and scripts send none. So a mutating request that names an origin is taken only from a
//! page of this very daemon reached on a loopback name. With a token set this check is not
//! needed: a page cannot add `Authorization` without a preflight, which this API never grants.
//!
//! Reads need no token, so a page whose site name its DNS points at 127.0.0.1 (DNS rebinding)
//! could read the whole API and `/metrics` from the browser, as the same origin as itself. Its
//! requests name the site in `Host`, though, and a daemon that listens only on loopback is
//! reached by loopback names alone, so such a daemon refuses a request naming any other host
//! (421) unless it carries the access token, which a page cannot add.
use std::net::SocketAddr;

use axum::http::uri::Authority;
use axum::http::{header, HeaderMap, Method, Uri};

/// Why a mutating request from a web page is refused, or `None` to take it.
pub fn browser_refusal(method: &Method, headers: &HeaderMap) -> Option<String> {
    if matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS) {
        return None;
    }
    let origin = headers.get(header::ORIGIN)?;
    let origin_text = String::from_utf8_lossy(origin.as_bytes()).into_owned();
    let host = headers.get(header::HOST).and_then(|h| h.to_str().ok());
    if host.is_some_and(|host| is_own_loopback_page(&origin_text, host)) {
        return None;
    }
    Some(format!(
        "refused a change sent by a web page (Origin: {origin_text}): without an admin access token this daemon takes changes only from clients that are not browsers (the strata CLI, curl) or from its own page on a loopback address; set http_token_file to admit clients by token instead"
    ))
}

/// Why a request to a daemon listening on `listen` is refused for the host it names, or `None`
/// to take it. Only a loopback listener checks: one on a routable address (which needs a token)
/// is reached under names and addresses it cannot know (its DNS names, each of its addresses,
/// a proxy's), and every host that reaches it may already read it, a page or not. A request
/// without `Host` (HTTP/1.0 tools) is taken: browsers always send one.
pub fn rebinding_refusal(listen: SocketAddr, headers: &HeaderMap) -> Option<String> {
    if !listen.ip().is_loopback() {
        return None;
    }
    let host = headers.get(header::HOST)?;
    let host_text = String::from_utf8_lossy(host.as_bytes()).into_owned();
    let named = host_text.parse::<Authority>().ok();
    if named.is_some_and(|a| is_loopback_name(a.host())) {
        return None;
    }
    Some(format!(
        "refused a request for host {host_text:?}: this daemon listens on loopback ({listen}), where a request naming another host is what a web page sends once its site's name points at 127.0.0.1 (DNS rebinding); ask for 127.0.0.1, [::1] or localhost, or send the admin access token (a proxy that passes another name on: set http_token_file and have it send the token, or listen on a non-loopback address)"
    ))
}

/// Whether `origin` is `http(s)://HOST` with HOST the request's own `Host` and a loopback name.
fn is_own_loopback_page(origin: &str, host: &str) -> bool {
    let Ok(uri) = origin.parse::<Uri>() else {
        return false;
    };
    let scheme_ok = matches!(uri.scheme_str(), Some("http" | "https"));
    let path_ok = matches!(uri.path(), "" | "/");
    let (Some(origin_authority), Ok(host_authority)) = (uri.authority(), host.parse::<Authority>())
    else {
        return false;
    };
    scheme_ok
        && path_ok
        && origin_authority
            .as_str()
            .eq_ignore_ascii_case(host_authority.as_str())
        && is_loopback_name(host_authority.host())
}

/// `localhost` and its subdomains (which resolve to loopback by definition, RFC 6761, and which
/// browsers never look up in DNS), with or without a final dot, and loopback addresses.
fn is_loopback_name(host: &str) -> bool {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let name = bare.strip_suffix('.').unwrap_or(bare).to_ascii_lowercase();
    name == "localhost"
        || name.ends_with(".localhost")
        || bare
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.to_canonical().is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(origin: Option<&str>, host: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(o) = origin {
            h.insert(header::ORIGIN, o.parse().unwrap());
        }
        if let Some(h2) = host {
            h.insert(header::HOST, h2.parse().unwrap());
        }
        h
    }

    #[test]
    fn only_web_pages_of_other_origins_are_refused() {
        let post = Method::POST;
        // The CLI and curl: no Origin.
        assert_eq!(
            browser_refusal(&post, &headers(None, Some("127.0.0.1:9090"))),
            None
        );
        // The daemon's own page, on loopback names.
        for (origin, host) in [
            ("http://127.0.0.1:9090", "127.0.0.1:9090"),
            ("http://localhost:9090", "localhost:9090"),
            ("http://LOCALHOST:9090", "localhost:9090"),
            ("http://[::1]:9090", "[::1]:9090"),
            ("http://127.0.0.2", "127.0.0.2"),
        ] {
            assert_eq!(
                browser_refusal(&post, &headers(Some(origin), Some(host))),
                None,
                "{origin}"
            );
        }
        // Another site, a site pointed at 127.0.0.1 (its Host is its own name), an opaque
        // origin, a loopback page of another port, garbage, and no Host at all.
        for (origin, host) in [
            ("https://evil.example", Some("127.0.0.1:9090")),
            ("http://evil.example:9090", Some("evil.example:9090")),
            ("null", Some("127.0.0.1:9090")),
            ("http://127.0.0.1:8080", Some("127.0.0.1:9090")),
            ("file://", Some("127.0.0.1:9090")),
            ("http://127.0.0.1:9090", None),
        ] {
            let why = browser_refusal(&post, &headers(Some(origin), host));
            assert!(
                why.as_deref().is_some_and(|w| w.contains(origin)),
                "{origin}: {why:?}"
            );
        }
        for method in [Method::PUT, Method::DELETE, Method::PATCH] {
            let h = headers(Some("https://evil.example"), Some("127.0.0.1:9090"));
            assert!(browser_refusal(&method, &h).is_some(), "{method}");
        }
        // Reads change nothing (and a browser does not let the page see the answer).
        let h = headers(Some("https://evil.example"), Some("127.0.0.1:9090"));
        assert_eq!(browser_refusal(&Method::GET, &h), None);
        assert_eq!(browser_refusal(&Method::HEAD, &h), None);
    }

    #[test]
    fn a_loopback_listener_takes_only_loopback_host_names() {
        let loopback: SocketAddr = "127.0.0.1:9090".parse().unwrap();
        for host in [
            "127.0.0.1:9090",
            "127.0.0.1",
            "127.1.2.3:9090",
            "localhost:9090",
            "LocalHost",
            "localhost.:9090",
            "dashboard.localhost:9090",
            "[::1]:9090",
            "[::1]",
            "[::ffff:127.0.0.1]:9090",
        ] {
            assert_eq!(
                rebinding_refusal(loopback, &headers(None, Some(host))),
                None,
                "{host}"
            );
        }
        // HTTP/1.0 tools send no Host; browsers always do.
        assert_eq!(rebinding_refusal(loopback, &headers(None, None)), None);
        for host in [
            "attacker.example:9090",
            "attacker.example",
            "localhost.attacker.example:9090",
            "127.0.0.1.attacker.example",
            "10.0.0.5:9090",
            "[::2]:9090",
            "not a host",
        ] {
            let why = rebinding_refusal(loopback, &headers(None, Some(host)));
            assert!(
                why.as_deref().is_some_and(|w| w.contains(host)
                    && w.contains("DNS rebinding")
                    && w.contains("127.0.0.1:9090")),
                "{host}: {why:?}"
            );
        }
        // A daemon on a routable address is reached by names it cannot know.
        for listen in ["0.0.0.0:9090", "192.168.1.20:9090", "[::]:9090"] {
            let listen: SocketAddr = listen.parse().unwrap();
            let h = headers(None, Some("storage1.example:9090"));
            assert_eq!(rebinding_refusal(listen, &h), None, "{listen}");
        }
    }
}
