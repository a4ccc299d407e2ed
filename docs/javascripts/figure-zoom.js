// Click a figure (or focus it and press Enter) to see it at full size; click, Esc or Enter closes.
// Local and tiny on purpose: the site loads nothing from the internet.
function openFigure(img) {
  const overlay = document.createElement("div");
  overlay.className = "figure-zoom";
  overlay.setAttribute("role", "dialog");
  overlay.setAttribute("aria-label", img.alt || "figure at full size");
  overlay.tabIndex = -1;
  const full = document.createElement("img");
  full.src = img.currentSrc || img.src;
  full.alt = img.alt;
  overlay.appendChild(full);
  const close = () => { overlay.remove(); img.focus(); };
  overlay.addEventListener("click", close);
  overlay.addEventListener("keydown", (event) => {
    if (["Escape", "Enter", " "].includes(event.key)) { event.preventDefault(); close(); }
  });
  document.body.appendChild(overlay);
  overlay.focus();
}

function makeFiguresZoomable() {
  for (const img of document.querySelectorAll(".md-content img:not(.figure-zoomable)")) {
    if (img.closest("a")) continue;  // an image that is a link keeps its link
    img.classList.add("figure-zoomable");
    img.tabIndex = 0;
    img.setAttribute("role", "button");
    img.title = "Click to see it at full size";
    img.addEventListener("click", () => openFigure(img));
    img.addEventListener("keydown", (event) => {
      if (event.key === "Enter") openFigure(img);
    });
  }
}

// Material may swap page content without a reload (document$); otherwise, run once on load.
if (typeof document$ !== "undefined") document$.subscribe(makeFiguresZoomable);
else document.addEventListener("DOMContentLoaded", makeFiguresZoomable);
