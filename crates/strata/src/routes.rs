//! A router that remembers what it serves. Every admin route is added through [`Routes`], so
//! the list of (method, path) pairs it returns is exactly what the daemon answers, and a test
//! can hold that list against the OpenAPI document (docs/openapi.json).
use axum::handler::Handler;
use axum::routing::{delete, get, post, put, MethodRouter};
use axum::Router;

/// One served route: an HTTP method and an axum path such as `/api/v1/volumes/{name}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Route {
    pub method: &'static str,
    pub path: &'static str,
}

pub struct Routes<S> {
    router: Router<S>,
    served: Vec<Route>,
}

impl<S: Clone + Send + Sync + 'static> Routes<S> {
    pub fn new() -> Self {
        Routes {
            router: Router::new(),
            served: Vec::new(),
        }
    }

    fn add(mut self, method: &'static str, path: &'static str, mr: MethodRouter<S>) -> Self {
        self.served.push(Route { method, path });
        // axum merges the method routers of one path added twice.
        self.router = self.router.route(path, mr);
        self
    }

    pub fn get<H: Handler<T, S>, T: 'static>(self, path: &'static str, h: H) -> Self {
        self.add("GET", path, get(h))
    }

    pub fn post<H: Handler<T, S>, T: 'static>(self, path: &'static str, h: H) -> Self {
        self.add("POST", path, post(h))
    }

    pub fn put<H: Handler<T, S>, T: 'static>(self, path: &'static str, h: H) -> Self {
        self.add("PUT", path, put(h))
    }

    pub fn delete<H: Handler<T, S>, T: 'static>(self, path: &'static str, h: H) -> Self {
        self.add("DELETE", path, delete(h))
    }

    pub fn merge(mut self, other: Routes<S>) -> Self {
        self.served.extend(other.served);
        self.router = self.router.merge(other.router);
        self
    }

    #[cfg(test)]
    pub fn served(&self) -> Vec<Route> {
        let mut all = self.served.clone();
        all.sort();
        all
    }

    pub fn into_router(self) -> Router<S> {
        self.router
    }
}
