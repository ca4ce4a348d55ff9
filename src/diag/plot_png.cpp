// `meshgrad plot -o loss.png`: the plot's SVG rendered by librsvg into a cairo image surface, written
// as PNG by cairo (diag/plot.hpp). The same SVG as the .svg output, so both show the same picture.
#include <cairo.h>
#include <fmt/format.h>
#include <librsvg/rsvg.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <memory>
#include <string>

#include "meshgrad/diag/plot.hpp"
#include "meshgrad/tensor/error.hpp"

namespace meshgrad::diag {

PlotFormat plot_format_for(const std::string& path, const std::string& option) {
  std::string ext = std::filesystem::path(path).extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return std::tolower(c); });
  if (ext == ".svg") return PlotFormat::svg;
  if (ext == ".png") return PlotFormat::png;
  throw InvalidArgument(fmt::format("plot: {} '{}' has the extension '{}'; the plot is written as .svg or .png", option,
                                    path, ext.empty() ? "(none)" : ext));
}

namespace {

struct GObjectUnref {
  void operator()(gpointer object) const { g_object_unref(object); }
};
struct SurfaceDestroy {
  void operator()(cairo_surface_t* s) const { cairo_surface_destroy(s); }
};
struct CairoDestroy {
  void operator()(cairo_t* c) const { cairo_destroy(c); }
};

// Takes a GError's message and frees it.
std::string message_of(GError* error) {
  std::string text = error != nullptr ? error->message : "unknown error";
  if (error != nullptr) g_error_free(error);
  return text;
}

cairo_status_t append_bytes(void* closure, const unsigned char* data, unsigned int length) {
  static_cast<std::string*>(closure)->append(reinterpret_cast<const char*>(data), length);
  return CAIRO_STATUS_SUCCESS;
}

}  // namespace

std::string svg_to_png(const std::string& svg, int width, int height) {
  MG_CHECK(width > 0 && height > 0, "plot: a PNG of {}x{} pixels", width, height);
  GError* error = nullptr;
  std::unique_ptr<RsvgHandle, GObjectUnref> handle(
      rsvg_handle_new_from_data(reinterpret_cast<const guint8*>(svg.data()), svg.size(), &error));
  MG_CHECK(handle != nullptr, "plot: librsvg cannot read the plot's SVG: {}", message_of(error));
  std::unique_ptr<cairo_surface_t, SurfaceDestroy> surface(cairo_image_surface_create(CAIRO_FORMAT_ARGB32, width, height));
  MG_CHECK(cairo_surface_status(surface.get()) == CAIRO_STATUS_SUCCESS, "plot: cairo cannot make a {}x{} image: {}",
           width, height, cairo_status_to_string(cairo_surface_status(surface.get())));
  std::unique_ptr<cairo_t, CairoDestroy> cairo(cairo_create(surface.get()));
  const RsvgRectangle viewport{0, 0, static_cast<double>(width), static_cast<double>(height)};
  MG_CHECK(rsvg_handle_render_document(handle.get(), cairo.get(), &viewport, &error) != FALSE,
           "plot: librsvg cannot render the plot: {}", message_of(error));
  std::string png;
  const cairo_status_t written = cairo_surface_write_to_png_stream(surface.get(), append_bytes, &png);
  MG_CHECK(written == CAIRO_STATUS_SUCCESS, "plot: cairo cannot encode the PNG: {}", cairo_status_to_string(written));
  return png;
}

}  // namespace meshgrad::diag
